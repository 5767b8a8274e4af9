"""FSDP2 sharding, activation checkpointing and compilation of a freshly built model."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lmforge.config.model import ModelConfig
from lmforge.model.llama import CausalLM
from lmforge.parallel.context import apply_context_parallel, context_kernel
from lmforge.parallel.experts import shard_experts
from lmforge.parallel.process_group import DistContext
from lmforge.parallel.tensor import apply_tensor_parallel


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """The forward/backward parameter dtype of `model.param_dtype` on `device`."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def fsdp_wraps(cfg: ModelConfig, ctx: DistContext, target: torch.device | None = None) -> bool:
    """Whether `parallelize` shards the model with FSDP2: on more than one rank, or with low-precision parameters
    (FSDP's mixed-precision policy keeps the fp32 master weights) on `target` (default: the rank's device)."""
    return ctx.world_size > 1 or resolve_param_dtype(cfg.param_dtype, target or ctx.device) != torch.float32


FULLGRAPH_BACKENDS = frozenset({"sdpa"})
"""Attention backends whose blocks compile with `fullgraph=True` (checked by tests/unit/test_compile.py)."""


def _saved_ops() -> list[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention kernels (the expensive ones)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")  # fmt: skip
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def apply_activation_checkpointing(blocks: list[nn.Module], freq: int, mode: str = "full") -> None:
    """Recompute every freq-th block's forward in backward: all of it (`full`), or all but the outputs of its
    matmuls and attention (`selective`). The module tree, and so every name, is unchanged."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _saved_ops())
    for i, block in enumerate(blocks):
        if i % freq == 0:
            block.forward = _checkpointed(block.forward, kwargs)  # type: ignore[method-assign]


def _checkpointed(forward: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """`forward` run under activation checkpointing. A closure, not a `functools.partial`: torch.compile skips a
    partial's frame, so a block whose forward were one would compile to nothing (an error with fullgraph=True)."""

    def run(*args: Any, **more: Any) -> Any:
        return checkpoint(forward, *args, **kwargs, **more)

    return run


def parallelize(
    model: CausalLM,
    blocks: list[nn.Module],
    cfg: ModelConfig,
    ctx: DistContext,
    target: torch.device | None = None,
    shard: bool = True,
    roots: Sequence[nn.Module] = (),
) -> CausalLM:
    """Split over the TP group, checkpoint, compile and shard (per block, then the root) a freshly built model, on
    the rank's device. Under pipeline parallelism `roots` are this rank's stage modules
    (`lmforge.parallel.pipeline`): each is an FSDP root of its own instead of the model.
    A model built on the meta device gets storage for this rank's shards only, uninitialized. The kernel under
    context parallelism and the parameter dtype are those of `target` (default: the rank's device; see
    `lmforge.parallel.model_setup.build_run_model`).

    A single process training in fp32 is not wrapped: FSDP over one rank would only copy parameters and gradients
    (5-10% of a CPU step, docs/benchmarks.md) and computes bit-identical results. With bf16 parameters FSDP's
    mixed-precision policy is what keeps fp32 master weights, so it wraps at any world size.

    With `shard` False the model gets context and expert parallelism and checkpointing but no FSDP, and stays on the
    device it was built on: `lmforge plan --check-cuda` runs it on fake CUDA tensors, where FSDP cannot run (it
    needs CUDA streams).
    """
    target = target or ctx.device
    if ctx.tp.size > 1:
        # first: context and expert parallelism and FSDP wrap the split layers
        # NCCL all-gathers float8 tensors (the plan's fake process group too); gloo has no float8 types
        float8_gather = target.type == "cuda"
        apply_tensor_parallel(model, ctx.tp, expert_parallel=ctx.ep.size > 1, float8_gather=float8_gather)
    if ctx.cp.size > 1:
        kernel = context_kernel(cfg.attn, target, model.arch.attention_sinks)
        apply_context_parallel(model, replace(ctx.cp, kernel=kernel))
    experts = shard_experts(model, ctx.ep) if ctx.ep.size > 1 else []
    if cfg.ac.mode != "none":
        apply_activation_checkpointing(blocks, cfg.ac.freq, cfg.ac.mode)
    if cfg.compile:
        # Backends verified to trace without a graph break compile as one graph per block; the others may break.
        # The expert-parallel exchange runs outside the graph (its sizes are host ints).
        fullgraph = getattr(model, "attn_backend", None) in FULLGRAPH_BACKENDS and not experts
        for block in blocks:
            block.compile(fullgraph=fullgraph)
    param_dtype = resolve_param_dtype(cfg.param_dtype, target)
    on_meta = any(p.is_meta for p in model.parameters())
    if not shard:
        return model
    if not fsdp_wraps(cfg, ctx, target):
        if not on_meta:
            return model.to(ctx.device)
        model.to_empty(device=ctx.device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # to_empty gives tied modules separate parameters
        return model
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in experts:
        # Each rank's experts shard over the ranks holding the same ones; the block around them over all ranks.
        fully_shard(module, mesh=ctx.ep.fsdp_mesh, mp_policy=mp)
    for i, block in enumerate(blocks):
        # The last block's backward comes right after its forward: resharding it would only gather it again. A
        # pipeline stage runs forwards of several micro-batches before their backwards: it keeps its blocks
        # gathered through the step rather than gathering them again for each micro-batch.
        fully_shard(block, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1 and not roots)
    # The root (embeddings, final norm, LM head) is used last in forward and first in backward: keep it unsharded.
    for root in roots or [model]:
        fully_shard(root, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=False)
    # Each block starts gathering the next one's parameters before its own compute, so the all-gather of block
    # i + 1 overlaps block i's forward even when the CPU issues kernels only just ahead of the GPU.
    for run in [list(root.layers) for root in roots] or [blocks]:  # type: ignore[union-attr]
        for block, following in itertools.pairwise(run):
            assert isinstance(block, FSDPModule)
            block.set_modules_to_forward_prefetch([following])  # type: ignore[list-item]
    if on_meta:
        # Each rank allocates only its own shards; the caller fills them (init, checkpoint or HF weights).
        model.to_empty(device=ctx.device)
    # Each micro-batch's loss is already divided by the step's global loss-token count, so gradients are summed
    # over ranks, not averaged (a plain sum: gloo has no PREMUL_SUM).
    for module in itertools.chain(model.modules(), roots):
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
