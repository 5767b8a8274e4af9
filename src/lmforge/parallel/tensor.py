"""Tensor parallelism: every block's matmuls split over the `tp` ranks of a group, with sequence parallelism for the
norms and the residual stream, and the LM head split over the vocabulary (loss parallel).

The layout, with DTensor's `parallelize_module`, for the [T, hidden] activations of one packed row:

- the residual stream between blocks, and every RMSNorm on it, holds T / tp tokens per rank (`Shard(0)`, sequence
  parallel);
- attention gathers the normed tokens (all-gather), runs q/k/v column-wise (each rank computes heads / tp query
  heads and kv_heads / tp KV heads, so grouped-query attention, QK-norm, RoPE, exclusive attention and the output
  gate stay per head and local), and `o_proj` row-wise, whose partial sums are reduce-scattered back to T / tp
  tokens;
- the dense MLP likewise: gate and up column-wise, down row-wise; an MoE block instead runs on the rank's own T / tp
  tokens with its weights whole (`_TokenLocal`), its routed experts split by expert parallelism when that is on;
- the embedding is split over the vocabulary (each rank looks up the ids in its range, the partial embeddings are
  reduce-scattered over tokens: `lmforge.model.vocab_parallel`); the LM head is split over the vocabulary too
  (column-wise), and the loss runs on the vocabulary-sharded logits without gathering them (`lmforge.model.loss`).

Gradients of the parameters every TP rank holds whole (norm scales, MoE weights) are partial sums on each rank;
FSDP, which always wraps a tensor-parallel model, reduces them before its reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.config.loader import ConfigError
from lmforge.model.llama import CausalLM
from lmforge.model.mlp import MLP
from lmforge.model.moe import MoE


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


def _block_plan(block: nn.Module, expert_parallel: bool) -> dict[str, object]:
    """The TP plan of one decoder block, by submodule name (`expert_parallel`: its routed experts are split over an
    expert-parallel group instead)."""
    plan: dict[str, object] = {
        "input_layernorm": SequenceParallel(sequence_dim=0),
        # x, cos, sin, mask: the normed tokens are gathered; the rotary tables and the mask are the whole row's.
        "self_attn": PrepareModuleInput(
            input_layouts=(TOKENS, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=TOKENS, use_local_output=False),
        "post_attention_layernorm": SequenceParallel(sequence_dim=0),
    }
    attn = block.self_attn
    if getattr(attn, "gate", "none") != "none":
        plan["self_attn.g_proj"] = ColwiseParallel()  # per-head gates: split like the query heads
    if attn.qk_norm:
        # Its scale sees this rank's heads only: a replicated parameter whose gradient is a partial sum.
        plan["self_attn.q_norm"] = _LocalReplicated()
        plan["self_attn.k_norm"] = _LocalReplicated()
    if isinstance(block.mlp, MoE):
        plan["mlp"] = _TokenLocal(skip=(block.mlp.experts,) if expert_parallel else ())
    elif isinstance(block.mlp, MLP):
        plan["mlp"] = PrepareModuleInput(input_layouts=(TOKENS,), desired_input_layouts=(Replicate(),))
        plan["mlp.gate_proj"] = ColwiseParallel()
        plan["mlp.up_proj"] = ColwiseParallel()
        plan["mlp.down_proj"] = RowwiseParallel(output_layouts=TOKENS, use_local_output=False)
    return plan


class _LocalReplicated(ParallelStyle):
    """A module replicated over the TP group that runs on local (per-head) activations: its parameters become
    replicated DTensors that it uses as their local copies (`RMSNorm`), whose gradients are partial sums over the
    group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)  # no partition function: every parameter replicated


class _TokenLocal(ParallelStyle):
    """A module that runs on this rank's own tokens of the sequence-parallel stream, with its parameters whole on
    every rank of the TP group (an MoE block: its router, routed and shared experts). Each parameter becomes a
    replicated DTensor that the module's forward sees as its local copy, so its gradient is this rank's tokens'
    part, a partial sum over the group (FSDP reduces it); the input's tokens are taken as local rows and the output
    given back as the same tokens of the stream. Buffers (routing statistics, the selection bias) stay plain: each
    rank counts its own tokens, and the step's reduction sums them.

    Modules in `skip` keep plain parameters: routed experts under expert parallelism, which the ranks of a TP group
    split like any other ranks (each sends its own tokens to the experts' owners)."""

    def __init__(self, skip: tuple[nn.Module, ...] = ()) -> None:
        super().__init__()
        self.skip = skip

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kept = {id(p) for m in self.skip for p in m.parameters()}
        for sub in module.modules():
            for key, param in list(sub._parameters.items()):
                if param is not None and not isinstance(param, DTensor) and id(param) not in kept:
                    replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
                    sub.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

        def enter(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            for sub in mod.modules():
                for key, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        swapped.append((sub, key, param))
                        sub._parameters[key] = param.to_local(grad_placements=(Partial(),))  # type: ignore[assignment]
            x = args[0]
            return (x.to_local() if isinstance(x, DTensor) else x, *args[1:])

        def leave(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> DTensor:
            while swapped:
                sub, key, param = swapped.pop()
                sub._parameters[key] = param
            return DTensor.from_local(out, device_mesh, [TOKENS])

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class _VocabRows(ParallelStyle):
    """An embedding table split by rows (the vocabulary) over the TP group, without input or output hooks: the
    decoder calls `lmforge.model.vocab_parallel.sharded_embedding` on it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, split)


def apply_tensor_parallel(model: CausalLM, tp: TensorShard, expert_parallel: bool = False) -> None:
    """Split `model` (fresh, on any device, before FSDP) over the TP group in place. Attention modules then count
    the heads of this rank (`num_heads`, `num_kv_heads`). MoE blocks run on each rank's own tokens, their weights
    whole on every rank of the group, or, with `expert_parallel`, their routed experts left to the expert-parallel
    split."""
    mesh = tp.mesh
    assert mesh is not None and tp.size > 1
    if model.vocab_size % tp.size:
        raise ConfigError(f"parallel.tp = {tp.size} does not divide the model's vocabulary of {model.vocab_size} "
                          "token ids (the embedding and LM head are split over it)")  # fmt: skip
    parallelize_module(
        model,
        mesh,
        {
            # split over the vocabulary; `lmforge.model.vocab_parallel` looks ids up without a host read
            "model.embed_tokens": _VocabRows(),
            "model.norm": SequenceParallel(sequence_dim=0),
            "lm_head": ColwiseParallel(use_local_output=False),
        },
    )
    for block in model.blocks:
        parallelize_module(block, mesh, _block_plan(block, expert_parallel))  # type: ignore[arg-type]
        attn = block.self_attn
        attn.num_heads //= tp.size
        attn.num_kv_heads //= tp.size
    model.tie_weights()  # both halves of a tied pair are split over the vocabulary alike: one parameter again
