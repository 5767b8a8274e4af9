"""Tensor parallelism: every block's matmuls split over the `tp` ranks of a group, with sequence parallelism for the
norms and the residual stream, and the LM head split over the vocabulary (loss parallel).

The layout, with DTensor's `parallelize_module`, for the [T, hidden] activations of one packed row:

- the residual stream between blocks, and every RMSNorm on it, holds T / tp tokens per rank (`Shard(0)`, sequence
  parallel);
- attention gathers the normed tokens (all-gather), runs q/k/v column-wise (each rank computes heads / tp query
  heads and kv_heads / tp KV heads, so grouped-query attention, QK-norm, RoPE, exclusive attention and the output
  gate stay per head and local), and `o_proj` row-wise, whose partial sums are reduce-scattered back to T / tp
  tokens;
- the dense MLP likewise: gate and up column-wise, down row-wise; an MoE block instead runs its router and routed
  experts on the rank's own T / tp tokens with their weights whole (`_TokenLocal`), the routed experts split by
  expert parallelism when that is on, and its shared experts split like the dense MLP;
- hyper-connections hold each rank's T / tp tokens of every copy of the widened stream (`_StreamLocal`);
- the embedding is split over the vocabulary (each rank looks up the ids in its range, the partial embeddings are
  reduce-scattered over tokens: `lmforge.model.vocab_parallel`); the LM head is split over the vocabulary too
  (column-wise), and the loss runs on the vocabulary-sharded logits without gathering them (`lmforge.model.loss`).

Gradients of the parameters every TP rank holds whole (norm scales, routers, routed experts, hyper-connections) are
partial sums on each rank; FSDP, which always wraps a tensor-parallel model, reduces them before its reduce-scatter.

Float8 layers (`model.fp8`) keep their splits. Their scales are the whole tensor's or row's, as in one process: DTensor
reduces the amax over the group. On CUDA, tensorwise layers use torchao's float8 styles, which cast the normed tokens
to float8 before the all-gather (half the bytes of bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.config.loader import ConfigError
from lmforge.model.fp8 import casts_tensorwise, float8_tp_styles
from lmforge.model.llama import CausalLM
from lmforge.model.mlp import MLP
from lmforge.model.moe import MoE
from lmforge.model.seq_balance import TokenSplit


@dataclass(frozen=True)
class TensorShard:
    """This rank's tensor-parallel group: `size` consecutive ranks that split every matmul between them."""

    mesh: DeviceMesh | None
    """The group's 1-D mesh (named "tp"); None without tensor parallelism."""
    rank: int
    """This rank's index in its group."""
    size: int
    """Ranks in the group (`parallel.tp`)."""


NO_TENSOR_PARALLEL = TensorShard(None, 0, 1)
"""A run without tensor parallelism."""

TOKENS = Shard(0)
"""Sequence-parallel placement of [T, hidden] activations: each rank holds T / tp consecutive tokens."""


def _colwise(module: nn.Module, float8_gather: bool) -> ParallelStyle:
    """A column-wise split of `module`: torchao's float8 style for a tensorwise float8 layer when `float8_gather`."""
    return float8_tp_styles()[0]() if float8_gather and casts_tensorwise(module) else ColwiseParallel()


def _rowwise(module: nn.Module, float8_gather: bool, local_output: bool = False) -> ParallelStyle:
    """A row-wise split of `module` whose partial sums are reduce-scattered back to the sequence-parallel stream
    (a DTensor, or its local rows with `local_output`): torchao's float8 style for a tensorwise float8 layer when
    `float8_gather`."""
    style = float8_tp_styles()[1] if float8_gather and casts_tensorwise(module) else RowwiseParallel
    return style(output_layouts=TOKENS, use_local_output=local_output)


def _mlp_plan(mlp: MLP, prefix: str, float8_gather: bool, local_output: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan of a gated MLP at `prefix`: its input gathered from the stream, gate and up column-wise, down
    row-wise back to the stream (its local rows with `local_output`)."""
    return {
        prefix: _gathered_input(mlp, ["gate_proj", "up_proj"], 0, float8_gather),
        f"{prefix}.gate_proj": _colwise(mlp.gate_proj, float8_gather),
        f"{prefix}.up_proj": _colwise(mlp.up_proj, float8_gather),
        f"{prefix}.down_proj": _rowwise(mlp.down_proj, float8_gather, local_output),
    }


def _gathered_input(parent: nn.Module, readers: list[str], others: int, float8_gather: bool) -> ParallelStyle:
    """Gather `parent`'s first input (the normed tokens) from the sequence-parallel stream for the column-wise
    layers `readers`, leaving its `others` further inputs as they are. With `float8_gather`, when every reader is a
    tensorwise float8 layer, the tokens are cast to float8 before the all-gather, once for all of them; a reader in
    high precision (a gate whose width does not suit float8) needs them in high precision, so then each float8 layer
    casts its own after the gather."""
    layouts = (TOKENS, *[None] * others)
    wanted = (Replicate(), *[None] * others)
    if float8_gather and all(casts_tensorwise(parent.get_submodule(name)) for name in readers):
        prepare = float8_tp_styles()[2]
        return prepare(input_layouts=layouts, desired_input_layouts=wanted, fwd_config_submodule_fqn=readers[0])
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=wanted)


def _block_plan(block: nn.Module, expert_parallel: bool, float8_gather: bool) -> dict[str, object]:
    """The TP plan of one decoder block, by submodule name (`expert_parallel`: its routed experts are split over an
    expert-parallel group instead; `float8_gather`: tensorwise float8 layers gather their inputs in float8)."""
    attn = block.self_attn
    readers = ["q_proj", "k_proj", "v_proj"] + (["g_proj"] if getattr(attn, "gate", "none") != "none" else [])
    plan: dict[str, object] = {
        "input_layernorm": SequenceParallel(sequence_dim=0),
        # x, cos, sin, mask: the normed tokens are gathered; the rotary tables and the mask are the whole row's.
        "self_attn": _gathered_input(attn, readers, 3, float8_gather),
        # per-head gates (g_proj) are split like the query heads
        **{f"self_attn.{name}": _colwise(attn.get_submodule(name), float8_gather) for name in readers},
        "self_attn.o_proj": _rowwise(attn.o_proj, float8_gather),
        "post_attention_layernorm": SequenceParallel(sequence_dim=0),
    }
    if attn.qk_norm:
        # Its scale sees this rank's heads only: a replicated parameter whose gradient is a partial sum.
        plan["self_attn.q_norm"] = _LocalReplicated()
        plan["self_attn.k_norm"] = _LocalReplicated()
    if isinstance(block.mlp, MoE):
        moe = block.mlp
        shared = moe.shared_experts
        skip = ((moe.experts,) if expert_parallel else ()) + ((shared,) if shared is not None else ())
        plan["mlp"] = _TokenLocal(skip=skip)
        if shared is not None:
            # split like a dense MLP: it gathers the tokens and gives this rank's rows back to the MoE's sum
            plan |= _mlp_plan(shared, "mlp.shared_experts", float8_gather, local_output=True)
    elif isinstance(block.mlp, MLP):
        plan |= _mlp_plan(block.mlp, "mlp", float8_gather)
    if block.attn_hc is not None:
        plan["attn_hc"] = _StreamLocal()
        plan["mlp_hc"] = _StreamLocal()
    return plan


class _LocalReplicated(ParallelStyle):
    """A module replicated over the TP group that runs on local (per-head) activations: its parameters become
    replicated DTensors that it uses as their local copies (`RMSNorm`), whose gradients are partial sums over the
    group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)  # no partition function: every parameter replicated


def _local(x: Any) -> Any:
    """x's local tensor when it is a DTensor, else x."""
    return x.to_local() if isinstance(x, DTensor) else x


class _TokenLocal(ParallelStyle):
    """A module that runs on this rank's own tokens of the sequence-parallel stream, with its parameters whole on
    every rank of the TP group (an MoE block: its router and routed experts). Each parameter becomes a
    replicated DTensor that the module's forward sees as its local copy, so its gradient is this rank's tokens'
    part, a partial sum over the group (FSDP reduces it); the input's tokens are taken as local rows and the output
    given back as the same tokens of the stream. Buffers (routing statistics, the selection bias) stay plain: each
    rank counts its own tokens, and the step's reduction sums them.

    Modules in `skip` keep their parameters as they are: routed experts under expert parallelism, which the ranks
    of a TP group split like any other ranks (each sends its own tokens to the experts' owners), and shared experts,
    which are split over the TP group like a dense MLP."""

    placement: Placement = TOKENS
    """How the module's output holds the stream's tokens."""

    def __init__(self, skip: tuple[nn.Module, ...] = ()) -> None:
        super().__init__()
        self.skip = skip

    def local_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The forward's arguments as the module sees them: its first, the tokens, as this rank's local rows."""
        return (_local(args[0]), *args[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kept = {id(p) for m in self.skip for p in m.parameters()}
        local: list[tuple[nn.Module, str]] = []
        for sub in module.modules():
            for key, param in list(sub._parameters.items()):
                if param is not None and not isinstance(param, DTensor) and id(param) not in kept:
                    replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
                    sub.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
                    local.append((sub, key))
        if isinstance(module, MoE):
            # its sequence-wise balance loss counts each segment's choices over the whole row
            group, rank, size = device_mesh.get_group(), device_mesh.get_local_rank(), device_mesh.size()
            module.token_split = TokenSplit((group,), run=rank, runs=size)
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

        def enter(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            for sub, key in local:
                param = sub._parameters[key]
                assert isinstance(param, DTensor)
                swapped.append((sub, key, param))
                sub._parameters[key] = param.to_local(grad_placements=(Partial(),))  # type: ignore[assignment]
            return self.local_args(args)

        def leave(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> DTensor:
            while swapped:
                sub, key, param = swapped.pop()
                sub._parameters[key] = param
            return DTensor.from_local(out, device_mesh, [self.placement])

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class _StreamLocal(_TokenLocal):
    """A hyper-connection on this rank's tokens of every copy of the stream [n, T, hidden] (`Shard(1)`), its weights
    whole on every rank of the TP group (as `_TokenLocal`). The sub-layer it wraps reads and writes the
    sequence-parallel stream, so the branch's result is taken as local rows too."""

    placement = Shard(1)

    def local_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The stream's local rows, and the branch with its result's local rows."""
        stream, branch = args
        return (_local(stream), lambda h: _local(branch(h)))


class _VocabRows(ParallelStyle):
    """An embedding table split by rows (the vocabulary) over the TP group, without input or output hooks: the
    decoder calls `lmforge.model.vocab_parallel.sharded_embedding` on it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, split)


def apply_tensor_parallel(
    model: CausalLM, tp: TensorShard, expert_parallel: bool = False, float8_gather: bool = False
) -> None:
    """Split `model` (fresh, on any device, before FSDP) over the TP group in place. Attention modules then count
    the heads of this rank (`num_heads`, `num_kv_heads`). MoE blocks run on each rank's own tokens, their router and
    routed experts whole on every rank of the group, or, with `expert_parallel`, their routed experts left to the
    expert-parallel split. With `float8_gather` (CUDA: NCCL all-gathers float8), tensorwise float8 layers gather
    their inputs in float8; gloo has no float8 types, so on the CPU each float8 layer casts its input after a
    high-precision gather. The float8 values are the same either way (a tensorwise scale is the whole tensor's);
    only the bytes gathered differ."""
    mesh = tp.mesh
    assert mesh is not None and tp.size > 1
    if model.vocab_size % tp.size:
        raise ConfigError(f"parallel.tp = {tp.size} does not divide the model's vocabulary of {model.vocab_size} "
                          "token ids (the embedding and LM head are split over it)")  # fmt: skip
    ends = {
        # split over the vocabulary; `lmforge.model.vocab_parallel` looks ids up without a host read
        (model.model, "embed_tokens"): _VocabRows(),
        (model.model, "norm"): SequenceParallel(sequence_dim=0),
        (model, "lm_head"): ColwiseParallel(use_local_output=False),
    }
    for (parent, name), style in ends.items():
        # a pipeline stage holds the embedding only where it is first, the norm and head where it is last
        if getattr(parent, name) is not None:
            parallelize_module(getattr(parent, name), mesh, style)
    for block in model.blocks:
        parallelize_module(block, mesh, _block_plan(block, expert_parallel, float8_gather))  # type: ignore[arg-type]
        attn = block.self_attn
        attn.num_heads //= tp.size
        attn.num_kv_heads //= tp.size
        if attn.sinks is not None:
            # one sink logit per query head: split like the heads, each rank's attention reads its own part
            attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, mesh, [Shard(0)]))
    model.tie_weights()  # both halves of a tied pair are split over the vocabulary alike: one parameter again
