"""Launchers that run torchtitan and litgpt on the CPU for `peers.py`, inside each peer's own virtual environment.

This file runs under the peer's interpreter (`benchmarks/.peers/<name>/bin/python`), which has torch and the peer
but not lmforge, so it imports only the standard library, torch (with numpy and safetensors, which both peers
install) and the peer. `peers.py` passes the run's settings (model shape, batch, steps, optimizer, and the files of
the shared start) as JSON in the `PEER_SPEC` environment variable:

    PEER_SPEC='{...}' torchrun --nproc-per-node N benchmarks/peer_shims.py torchtitan [torchtitan flags]
    PEER_SPEC='{...}' python benchmarks/peer_shims.py litgpt
    PEER_PROFILE=OUT:START:COUNT python benchmarks/peer_shims.py run -m lmforge train @ run.toml   # any side

With `PEER_PROFILE`, every side (`run` launches lmforge and the plain loop the same way) profiles its optimizer
steps START+1 .. START+COUNT with `torch.profiler` on rank 0 and writes the table of its top operators, by time
spent in the operator itself, to OUT. The steps are counted by a hook on every `torch.optim` optimizer's step, the
one place all sides share, so no side's own code is changed.

Every side of the comparison starts from the same weights and trains on the same tokens: `peers.py` writes
lmforge's initial weights (a safetensors file under Hugging Face Llama names) and the token windows of lmforge's
steps (a .npy), and each peer loads them here into its own model and data path (`start_weights`,
`start_windows`); the peer's trainer, optimizer and step stay its own.

What each peer gets from here, and why (everything else is the peer's own code and defaults):

- torchtitan 0.3.0 has no CPU path: with no accelerator it picks "cuda" as its device type, its memory monitor
  calls functions only `torch.cuda` has, and every model imports its Triton kernels for MoE expert parallelism.
  `cpu_shim`, run before torchtitan is imported, makes torch report "cpu" as the available device type, gives
  `torch.cpu` those few functions (peak memory reads the process's peak resident set) and registers a stand-in for
  the Triton kernels' module; it also bridges a torch-2.13 gap (`set_timeout`) and two gloo ones (a barrier given
  `device_ids=["cpu"]`, FSDP's `PREMUL_SUM` reduction). Its config is Python, not TOML (`--module M --config F`
  names a function that returns a `Trainer.Config`): `titan_config` builds one for the benchmark's Llama with
  torchtitan's own layer builder and inits. Flex attention, torchtitan's attention for language models, has no
  backward on the CPU, so the layers get torchtitan's SDPA module instead (causal; every row is one document).
  Its text loaders read Hugging Face datasets and need a tokenizer, so `titan_config` plugs in a loader of the
  shared windows and a tokenizer that is never called. The shared weights are copied in right after torchtitan's
  own init (`init_weights`, once the model is sharded), mapped to its names and layouts (`titan_weights`).
  Under pipeline parallelism (`peers.py --pp`): torchtitan 0.3.0 passes torch's pipeline schedules a step's
  micro-batches already cut (`step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`), keywords torch 2.13's `step`
  lacks (it cuts a whole batch itself, and fails with `Expecting 8 arg_mbs but got 1`), so
  `_pipeline_step_of_microbatches` gives `step` those keywords, running torch's own `_step_microbatches` on the
  micro-batches; each stage (model part) is inited apart, so it takes only its own share of the shared weights;
  `titan_config` cuts the stages as lmforge does (`module_fqns_per_model_part`), and the loader hands out the step's
  windows one micro-batch at a time, as torchtitan asks for them under PP. gloo's send and receive, which the
  stages use between ranks, need nothing.
- litgpt 0.5.13 runs on the CPU as it is; `run_litgpt` calls `litgpt.pretrain.setup` (the function behind
  `litgpt pretrain`) with a `litgpt.Config` of the same Llama, the shared weights as its initial checkpoint
  (`lit_weights`) and a data set of the shared windows, since its pretraining data modules download and tokenize
  corpora.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SPEC_ENV = "PEER_SPEC"
"""Environment variable holding the run's settings as JSON (see `peers.PeerSpec`)."""
PROFILE_ENV = "PEER_PROFILE"
"""Environment variable asking for a profile: `OUT:START:COUNT` (see the module's docstring)."""
PROFILE_ROWS = 25
"""Operators in a profile's table."""


def spec() -> dict[str, Any]:
    """The run's settings, from `PEER_SPEC`."""
    return json.loads(os.environ[SPEC_ENV])


# ---------------------------------------------------------------------------------------------- the shared start


def start_weights() -> dict[str, Any]:
    """The initial weights every side starts from (`PEER_SPEC`'s `weights`): a safetensors file of lmforge's
    model under Hugging Face Llama names, fp32."""
    from safetensors.torch import load_file

    return load_file(spec()["weights"])


def start_windows() -> Any:
    """The token windows of every step (`PEER_SPEC`'s `windows`): int64 [N, seq_len + 1], step k's windows at rows
    k x W .. (k + 1) x W - 1 (W windows per step over all ranks), data-parallel rank r of P taking the r-th P-th."""
    import numpy as np
    import torch

    return torch.from_numpy(np.load(spec()["windows"])).long()


def window_rows(windows: Any, step: int, rank: int, ranks: int, rows: int) -> Any:
    """Rank `rank`'s `rows` windows of step `step` (from 0), from the start again after the last window."""
    import torch

    first = (step * ranks + rank) * rows
    return windows[torch.arange(first, first + rows) % windows.shape[0]]


def _layer_weights(hf: dict[str, Any], layer: int) -> dict[str, Any]:
    """One decoder layer's tensors by their short Llama names (`q_proj`, `input_layernorm`, ...)."""
    prefix = f"model.layers.{layer}."
    return {name[len(prefix) :].rsplit(".", 2)[-2]: t for name, t in hf.items() if name.startswith(prefix)}


def _num_layers(hf: dict[str, Any]) -> int:
    return 1 + max(int(name.split(".")[2]) for name in hf if name.startswith("model.layers."))


# ---------------------------------------------------------------------------------------------- profiling


def profile_from_env() -> None:
    """When `PEER_PROFILE` is set (rank 0 only), profile the optimizer steps it names and write their table."""
    setting = os.environ.get(PROFILE_ENV)
    if not setting or os.environ.get("RANK", "0") != "0":
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out, start, count = setting.rsplit(":", 2)
    first, last = int(start) + 1, int(start) + int(count)
    state: dict[str, Any] = {"steps": 0, "optimizer": None, "profiler": None}

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        # A trainer may hold several optimizers (one per parameter group kind); count the first one's steps.
        if state["optimizer"] is None:
            state["optimizer"] = id(optimizer)
        if id(optimizer) != state["optimizer"]:
            return
        state["steps"] += 1
        if state["steps"] == first - 1:
            state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["profiler"].__enter__()
        elif state["steps"] == last and state["profiler"] is not None:
            profiler, state["profiler"] = state["profiler"], None
            profiler.__exit__(None, None, None)
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
            Path(out).write_text(f"optimizer steps {first}..{last}\n{table}\n", encoding="utf-8")

    register_optimizer_step_post_hook(after_step)


def run_program(argv: list[str]) -> None:
    """`run -m MODULE ARGS` or `run SCRIPT ARGS`: run a Python program as `python` would, after `profile_from_env`."""
    import runpy

    profile_from_env()
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------- the CPU shim


def _peak_rss_bytes() -> int:
    """This process's peak resident set (`VmHWM`), in bytes; 0 where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_shim() -> None:
    """Let a trainer written for accelerators pick the CPU: torch reports "cpu" as the available device type,
    and `torch.cpu` gains the memory functions `torch.cuda` has (only those it lacks). Nothing changes on a
    machine with an accelerator. Must run before the trainer is imported: torchtitan reads the device type once,
    at import."""
    import torch
    import torch._utils

    if torch.accelerator.is_available():
        return
    # torchtitan: `_get_available_device_type() or "cuda"`; None (no accelerator) would make it "cuda".
    torch._utils._get_available_device_type = lambda: "cpu"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def memory_stats(device: object = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    functions: dict[str, Any] = {
        "get_device_name": lambda device=None: platform.processor() or "cpu",
        "get_device_properties": lambda device=None: SimpleNamespace(total_memory=memory, name="cpu"),
        "memory_stats": memory_stats,
        # A reset would have to clear the kernel's peak RSS, which peers.py reads at the end of the run.
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }
    for name, fn in functions.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    _barrier_without_cpu_device_ids()
    _stand_in_for_triton_kernels()


def _barrier_without_cpu_device_ids() -> None:
    """torchtitan calls `barrier(device_ids=[device_module.current_device()])`, which on the CPU is `["cpu"]`, a
    type the barrier rejects; device ids only tell NCCL which GPU to use, so the wrapper drops ids that are not
    ints (`torch.cpu.current_device` itself must keep returning "cpu": FSDP builds devices from it)."""
    import torch.distributed as dist

    barrier = dist.barrier

    def cpu_barrier(group: Any = None, async_op: bool = False, device_ids: list[Any] | None = None) -> Any:
        if device_ids is not None and not all(isinstance(i, int) for i in device_ids):
            device_ids = None
        return barrier(group=group, async_op=async_op, device_ids=device_ids)

    dist.barrier = cpu_barrier
    if not hasattr(dist, "set_timeout"):
        # torchtitan 0.3.0 targets a torch whose `set_timeout` is public; torch 2.13 has it as `_set_pg_timeout`
        # (same arguments). It sets the process groups' timeout after the first step.
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
"""torchtitan's Triton kernels for MoE expert parallelism on CUDA: every model imports them (through its MoE
token dispatcher), and they import Triton, which a CPU build of torch does not install."""


def _stand_in_for_triton_kernels() -> None:
    """Where Triton is missing, register a stand-in module for `TRITON_KERNELS` whose every name is a function
    that fails when called: a dense model never calls them. (A stand-in for Triton itself would make torch's
    compiler believe Triton is there.)"""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is not None:
        return

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # module attributes that tools probe for (`__file__`, ...)

        def kernel(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{TRITON_KERNELS}.{name} needs Triton (MoE expert parallelism on CUDA)")

        return kernel

    stand_in = types.ModuleType(TRITON_KERNELS, "stand-in: MoE expert-parallel Triton kernels, not on the CPU")
    stand_in.__getattr__ = missing  # type: ignore[method-assign]  # module-level __getattr__ (PEP 562)
    sys.modules[TRITON_KERNELS] = stand_in


# ---------------------------------------------------------------------------------------------- torchtitan


def titan_config() -> Any:
    """The torchtitan `Trainer.Config` of the run in `PEER_SPEC` (torchtitan's `--config` function).

    The model is torchtitan's Llama 3 built by its own layer builder, with the benchmark's shape, RoPE without
    Llama 3.1's frequency scaling (theta as given) and torchtitan's inits; attention is torchtitan's SDPA module
    (`is_causal=True`): its language-model default, flex attention, cannot train on the CPU. Loss, optimizer and
    parallelism are torchtitan's defaults for its Llama configs (chunked cross-entropy, AdamW over every parameter,
    FSDP2 over the ranks); the changes are fp32 parameters (its default casts them to bf16 under FSDP), no
    activation checkpointing (its default is selective), a constant learning rate, and no checkpoint or validation.
    """
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    s = spec()
    model_spec = llama3.model_registry("debugmodel")
    base = model_spec.model
    vocab, dim = s["vocab_size"], s["hidden_size"]
    head_dim = dim // s["num_heads"]
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,  # as all of torchtitan's Llama 3 flavors
        n_layers=s["num_layers"],
        dim=dim,
        n_heads=s["num_heads"],
        n_kv_heads=s["num_kv_heads"],
        hidden_dim=s["intermediate_size"],
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=s["seq_len"], theta=s["rope_theta"], scaling="none"),
        attn_backend="flex",
    )
    # Flex attention has no backward on the CPU (torch raises): use torchtitan's own SDPA module instead, the fused
    # causal kernel, which is exact here because every row is one document.
    for layer in layers:
        for _, _, parent, attr in layer.traverse(FlexAttention.Config):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    model_spec.model = dataclasses.replace(
        base,
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=dataclasses.replace(base.tok_embeddings, num_embeddings=vocab, embedding_dim=dim),
        norm=dataclasses.replace(base.norm, normalized_shape=dim),
        lm_head=dataclasses.replace(base.lm_head, in_features=dim, out_features=vocab),
        layers=layers,
    )
    loader, tokenizer = _titan_plugins()
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=s["out_dir"],
        dump_folder=s["out_dir"],
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))
        ),
        optimizer=default_adamw(
            lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"], weight_decay=s["weight_decay"]
        ),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(
            local_batch_size=s["local_batch"],
            seq_len=s["seq_len"],
            steps=s["steps"],
            max_norm=s["max_norm"],
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        tokenizer=tokenizer.Config(),
        dataloader=loader.Config(),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint=None,
        # Under PP, the stages cut as lmforge's (`peers.Settings.stage_layers`, torchtitan's own default cut):
        # the command line's `--parallelism.*` flags set the rest.
        parallelism=ParallelismConfig(module_fqns_per_model_part=_titan_stage_modules(s["pp_layers"])),
    )


def _titan_stage_modules(layers: list[int] | None) -> list[list[str]] | None:
    """torchtitan's module names of each pipeline stage holding `layers[i]` decoder layers (the embedding with the
    first stage, the final norm and LM head with the last); None without a pipeline."""
    if not layers:
        return None
    stages, first = [], 0
    for i, count in enumerate(layers):
        names = [f"layers.{j}" for j in range(first, first + count)]
        first += count
        stages.append((["tok_embeddings"] if i == 0 else []) + names + (["norm", "lm_head"] if i == len(layers) - 1
                                                                        else []))  # fmt: skip
    return stages


def _titan_plugins() -> tuple[type, type]:
    """torchtitan's extension points for data: a loader of the shared windows and a tokenizer that is never called.

    Defined on first use: they subclass torchtitan's classes, which must not be imported before `cpu_shim`."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class SharedWindows(BaseDataLoader):
        """This rank's rows of `start_windows`, step after step, each row one document. No `positions`: with them,
        torchtitan would build a document mask, which its SDPA module cannot take. Under PP torchtitan asks its
        loader for one micro-batch at a time (`local_batch_size` is then the micro-batch's rows): the step's rows
        (`PEER_SPEC`'s `local_batch`) come in consecutive chunks of that size."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any, *, dp_rank: int, dp_world_size: int, seq_len: int, local_batch_size: int,
                     **_: Any) -> None:  # fmt: skip
            self.windows, self.rank, self.ranks = start_windows(), dp_rank, dp_world_size
            self.rows, self.chunk = int(spec()["local_batch"]), local_batch_size
            if self.windows.shape[1] != seq_len + 1:
                raise ValueError(f"windows of {self.windows.shape[1]} tokens for seq_len {seq_len}")
            if self.rows % self.chunk:
                raise ValueError(f"{self.rows} windows a step do not split into batches of {self.chunk}")

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            step = 0
            while True:
                rows = window_rows(self.windows, step, self.rank, self.ranks, self.rows)
                step += 1
                for tokens in rows.split(self.chunk):
                    yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    class NoTokenizer(BaseTokenizer):
        """Stands in for the Hugging Face tokenizer torchtitan loads: token windows need none."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any = None, *, tokenizer_path: str = "") -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("the benchmark feeds token ids")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("the benchmark feeds token ids")

        def get_vocab_size(self) -> int:
            return int(spec()["vocab_size"])

    return SharedWindows, NoTokenizer


def adjacent_rope_pairs(weight: Any, heads: int) -> Any:
    """A query or key projection [heads x head_dim, dim] with its rows reordered from the half-split RoPE layout
    (lmforge's and Hugging Face's: channel i turns with channel i + head_dim / 2) to adjacent pairs (torchtitan's
    complex RoPE: channel 2i turns with channel 2i + 1), at the same frequency. Queries and keys move alike, so
    their dot products, and with them the attention, stay the same."""
    rows, cols = weight.shape
    half = rows // heads // 2
    # [head, which half, i] -> [head, i, which half]: row i goes to 2i, row half + i to 2i + 1.
    return weight.reshape(heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def titan_weights(hf: dict[str, Any], heads: int, kv_heads: int, fused_qkv: bool) -> dict[str, Any]:
    """The tensors of `start_weights` under torchtitan's Llama 3 parameter names and layouts: queries and keys in
    adjacent RoPE pairs, and with `fused_qkv` one `wqkv` per layer whose rows go by key/value group (the group's
    query heads, its key head, its value head)."""
    import torch

    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "lm_head.weight": hf["lm_head.weight"],
    }
    for i in range(_num_layers(hf)):
        w = _layer_weights(hf, i)
        q, k, v = adjacent_rope_pairs(w["q_proj"], heads), adjacent_rope_pairs(w["k_proj"], kv_heads), w["v_proj"]
        at = f"layers.{i}.attention."
        if fused_qkv:
            cols = q.shape[1]
            groups = [q.reshape(kv_heads, -1, cols), k.reshape(kv_heads, -1, cols), v.reshape(kv_heads, -1, cols)]
            out[at + "qkv_linear.wqkv.weight"] = torch.cat(groups, dim=1).reshape(-1, cols)
        else:
            out |= {at + "qkv_linear.wq.weight": q, at + "qkv_linear.wk.weight": k, at + "qkv_linear.wv.weight": v}
        out[at + "wo.weight"] = w["o_proj"]
        out[f"layers.{i}.attention_norm.weight"] = w["input_layernorm"]
        out[f"layers.{i}.ffn_norm.weight"] = w["post_attention_layernorm"]
        ffn = f"layers.{i}.feed_forward."
        out |= {ffn + "w1.weight": w["gate_proj"], ffn + "w3.weight": w["up_proj"], ffn + "w2.weight": w["down_proj"]}
    return out


WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
"""Name parts that wrappers (torch.compile, activation checkpointing, FSDP1) add to a parameter's name."""


def copy_weights(model: Any, tensors: dict[str, Any], stage: bool = False) -> None:
    """Copy `tensors` (full, by parameter name) into every parameter of `model`, plain or DTensor (each rank keeps
    its own shard of the full tensor, which every rank holds); every parameter must be given, and nothing else but,
    with `stage` (`model` is one pipeline stage of the model, which keeps its parameters' full names), the other
    stages' parameters."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = {}
    for name, param in model.named_parameters():
        for part in WRAPPERS:
            name = name.replace(part, "")
        params[name] = param
    if stage:
        tensors = {name: t for name, t in tensors.items() if name in params}
    if params.keys() != tensors.keys():
        missing, extra = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
        raise KeyError(f"initial weights do not fit the model: missing {missing}, unknown {extra}")
    with torch.no_grad():
        for name, param in params.items():
            full = tensors[name].to(param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            elif tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{name}: initial weight {tuple(full.shape)}, parameter {tuple(param.shape)}")
            param.copy_(full)


def _titan_start_weights() -> None:
    """After torchtitan's own init of a model (`init_weights`, called once the model is sharded and allocated),
    overwrite its parameters with `start_weights`."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.protocols.model import BaseModel

    own_init = BaseModel.init_weights

    def init_then_load(self: Any, **kwargs: Any) -> None:
        own_init(self, **kwargs)
        s = spec()
        fused = any(isinstance(m, FusedQKVLinear) for m in self.modules())
        # Under PP, torchtitan inits each rank's stages (model parts) apart: each takes its own tensors.
        copy_weights(self, titan_weights(start_weights(), s["num_heads"], s["num_kv_heads"], fused),
                     stage=bool(s.get("pp_layers")))  # fmt: skip

    BaseModel.init_weights = init_then_load  # type: ignore[method-assign]


def _sum_reduction_on_gloo() -> None:
    """torchtitan scales the loss by the step's global token count itself and sets FSDP's gradient divide factor
    to 1, for which FSDP reduce-scatters with `PREMUL_SUM(1.0)`, an op gloo lacks. On the CPU, also ask FSDP for a
    plain SUM: the same reduction (a factor of 1)."""
    import torch

    if torch.accelerator.is_available():
        return
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    divide_by_one = fsdp.disable_fsdp_gradient_division

    def divide_by_one_with_sum(model: torch.nn.Module) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = divide_by_one_with_sum


def _pipeline_step_of_microbatches() -> None:
    """torchtitan 0.3.0 hands torch's pipeline schedules a step's micro-batches already cut
    (`schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`, torch's newer keyword arguments); torch 2.13's
    `step` takes the whole batch and cuts it itself, so those keywords reach it as model inputs and its check fails
    (`ValueError: Expecting 8 arg_mbs but got 1`). Where `step` lacks them, a step given them does what torch's
    `step` does after cutting: it resets the stages' state for the step and runs `_step_microbatches` (torch 2.13's
    method for a list of micro-batches) on them."""
    import inspect

    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        whole_batch_step = cls.step
        if "arg_mbs" in inspect.signature(whole_batch_step).parameters:
            continue

        def step(self: Any, *args: Any, whole_batch_step: Any = whole_batch_step, **kwargs: Any) -> Any:
            if not {"arg_mbs", "kwarg_mbs", "target_mbs"} & kwargs.keys():
                return whole_batch_step(self, *args, **kwargs)
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            names = ("arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs", "loss_kwargs")
            self._step_microbatches(**{name: kwargs[name] for name in names if name in kwargs})
            if kwargs.get("return_outputs", True):
                last = [stage for stage in stages if stage.is_last]
                return self._merge_outputs(last[0].output_chunks) if last else None
            return None

        cls.step = step  # type: ignore[method-assign]


def run_torchtitan(argv: list[str]) -> None:
    """torchtitan's training entry point (`torchtitan.train.main`) with `argv` as its flags, after the CPU shim.
    Without `--module`/`--config`, the run's config is `titan_config` of this file."""
    cpu_shim()
    _sum_reduction_on_gloo()
    _pipeline_step_of_microbatches()
    _titan_start_weights()
    if "--module" not in argv:
        # torchtitan imports the module by name; the folder of this file is on sys.path when it runs as a script.
        argv = ["--module", "peer_shims", "--config", "titan_config", *argv]
    sys.argv = [sys.argv[0], *argv]
    from torchtitan.train import main

    main()


# ---------------------------------------------------------------------------------------------- litgpt


class WindowRows:
    """A map-style data set of the rows of `start_windows` (seq_len + 1 tokens each; pretrain cuts inputs and
    targets from them), row i the i-th window, from the first again after the last: read in order, one batch of W
    rows is one step's windows. At module level and holding only a path, so that litgpt can pickle it into its
    checkpoint with the data loader."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._windows: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self._windows = state["path"], None

    def __len__(self) -> int:
        return 2**40  # endless in practice: the run stops at its token budget

    def __getitem__(self, index: int) -> Any:
        import numpy as np
        import torch

        if self._windows is None:
            self._windows = torch.from_numpy(np.load(self.path)).long()
        return self._windows[index % self._windows.shape[0]]


def lit_weights(hf: dict[str, Any]) -> dict[str, Any]:
    """The tensors of `start_weights` under litgpt's `GPT` names: one `attn.qkv` per layer holding the query rows,
    then the key rows, then the value rows (litgpt splits its output by those sizes); litgpt's RoPE turns the two
    halves of a head as lmforge's does, so no row moves."""
    import torch

    out = {
        "transformer.wte.weight": hf["model.embed_tokens.weight"],
        "transformer.ln_f.weight": hf["model.norm.weight"],
        "lm_head.weight": hf["lm_head.weight"],
    }
    for i in range(_num_layers(hf)):
        w, h = _layer_weights(hf, i), f"transformer.h.{i}."
        out[h + "norm_1.weight"] = w["input_layernorm"]
        out[h + "attn.qkv.weight"] = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
        out[h + "attn.proj.weight"] = w["o_proj"]
        out[h + "norm_2.weight"] = w["post_attention_layernorm"]
        out[h + "mlp.fc_1.weight"] = w["gate_proj"]
        out[h + "mlp.fc_2.weight"] = w["up_proj"]
        out[h + "mlp.proj.weight"] = w["down_proj"]
    return out


def run_litgpt() -> None:
    """`litgpt.pretrain.setup` for the run in `PEER_SPEC`: the same Llama as a `litgpt.Config`, started from
    `start_weights` (written as a litgpt checkpoint, its `initial_checkpoint_dir`, which it loads over its own
    init) and trained on `start_windows`, fp32, AdamW at a constant learning rate, one micro-batch per step, no
    validation or checkpoint between steps (litgpt still writes its final checkpoint after the last step). litgpt
    compiles the model itself."""
    import torch
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.data import DataModule
    from litgpt.pretrain import setup
    from torch.utils.data import DataLoader

    s = spec()
    devices = s["procs"]

    @dataclasses.dataclass
    class WindowData(DataModule):
        """A litgpt data module of the shared windows."""

        batch_size: int = 1

        def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
            self.batch_size = batch_size

        def train_dataloader(self) -> DataLoader:
            return DataLoader(WindowRows(s["windows"]), batch_size=self.batch_size)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(WindowRows(s["windows"]), batch_size=self.batch_size)

    config = Config(
        name="lmforge-peers-llama",
        block_size=s["seq_len"],
        vocab_size=s["vocab_size"],
        padded_vocab_size=s["vocab_size"],
        n_layer=s["num_layers"],
        n_head=s["num_heads"],
        n_query_groups=s["num_kv_heads"],
        n_embd=s["hidden_size"],
        head_size=s["hidden_size"] // s["num_heads"],
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=s["norm_eps"],
        mlp_class_name="LLaMAMLP",
        intermediate_size=s["intermediate_size"],
        rope_base=int(s["rope_theta"]),
    )
    batch = s["local_batch"] * devices
    train = TrainArgs(
        save_interval=None,
        log_interval=1,
        global_batch_size=batch,
        micro_batch_size=s["local_batch"],
        max_tokens=s["steps"] * batch * s["seq_len"],
        max_norm=s["max_norm"],
        min_lr=s["lr"],  # cosine decay from lr to lr: a constant learning rate
        lr_warmup_steps=0,
        tie_embeddings=False,
    )
    optimizer = {
        "class_path": "torch.optim.AdamW",
        "init_args": {
            "lr": s["lr"],
            "betas": (s["beta1"], s["beta2"]),
            "eps": s["eps"],
            "weight_decay": s["weight_decay"],
        },
    }
    initial = Path(s["out_dir"]) / "initial"
    initial.mkdir(parents=True, exist_ok=True)
    torch.save(lit_weights(start_weights()), initial / "lit_model.pth")
    # With its final checkpoint litgpt saves its hyperparameters by parsing the command line as `litgpt pretrain`'s
    # arguments; give it the one it requires, the model name, as `litgpt pretrain <name>` would have.
    sys.argv = [sys.argv[0], config.name]
    setup(
        model_name=config.name,
        model_config=config,
        initial_checkpoint_dir=initial,
        out_dir=Path(s["out_dir"]),
        precision="32-true",
        data=WindowData(),
        train=train,
        eval=EvalArgs(interval=10**9, max_iters=1, initial_validation=False, final_validation=False),
        optimizer=optimizer,
        devices=devices,
        logger_name="csv",
        seed=s["seed"],
    )


def main(argv: list[str]) -> int:
    """`peer_shims.py torchtitan [torchtitan flags]`, `peer_shims.py litgpt` (no flags: all in `PEER_SPEC`) or
    `peer_shims.py run (-m MODULE | SCRIPT) [ARGS]`."""
    if argv[:1] == ["torchtitan"]:
        profile_from_env()
        run_torchtitan(argv[1:])
    elif argv == ["litgpt"]:
        profile_from_env()
        run_litgpt()
    elif argv[:1] == ["run"] and argv[1:]:
        run_program(argv[1:])
    else:
        print("usage: peer_shims.py torchtitan [torchtitan flags] | litgpt | run (-m MODULE | SCRIPT) [ARGS]",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
