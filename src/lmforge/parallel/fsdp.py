"""Process group, device mesh, FSDP2 sharding, activation checkpointing and compilation.

One code path for every world size: a plain `lmforge train` is a process group of one, `torchrun` gives many.
CPU runs use gloo; CUDA runs use NCCL (with gloo for CPU tensors).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lmforge.config.model import ModelConfig


@dataclass
class DistContext:
    """Where this process sits in the run."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    device: torch.device
    """The compute device of this rank."""
    mesh: DeviceMesh
    """1-D mesh over all ranks (data parallel / FSDP)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory and the console."""
        return self.rank == 0


def env_world_size() -> int:
    """The world size torchrun announces, 1 for a plain process (usable before the process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_minutes: float = 30.0) -> DistContext:
    """Start (or join) the process group from torchrun's environment, or as a group of one."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device if use_cuda else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistContext(dist.get_rank(), world, local_rank, device, mesh)


def shutdown_distributed() -> None:
    """Leave the process group. The barrier first: gloo can abort at exit when a peer is still tearing down."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """The forward/backward parameter dtype of `model.param_dtype` on `device`."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


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
            block.forward = functools.partial(checkpoint, block.forward, **kwargs)  # type: ignore[method-assign]


def parallelize(model: nn.Module, blocks: list[nn.Module], cfg: ModelConfig, ctx: DistContext) -> nn.Module:
    """Checkpoint, compile and shard (per block, then the root) a freshly built model, on the rank's device.
    A model built on the meta device gets storage for this rank's shards only, uninitialized.

    A single process training in fp32 is not wrapped: FSDP over one rank would only copy parameters and gradients
    (5-10% of a CPU step, docs/benchmarks.md) and computes bit-identical results. With bf16 parameters FSDP's
    mixed-precision policy is what keeps fp32 master weights, so it wraps at any world size.
    """
    if cfg.ac.mode != "none":
        apply_activation_checkpointing(blocks, cfg.ac.freq, cfg.ac.mode)
    if cfg.compile:
        # Backends verified to trace without a graph break compile as one graph per block; the others may break.
        fullgraph = getattr(model, "attn_backend", None) in FULLGRAPH_BACKENDS
        for block in blocks:
            block.compile(fullgraph=fullgraph)
    param_dtype = resolve_param_dtype(cfg.param_dtype, ctx.device)
    on_meta = any(p.is_meta for p in model.parameters())
    if ctx.world_size == 1 and param_dtype == torch.float32:
        if not on_meta:
            return model.to(ctx.device)
        model.to_empty(device=ctx.device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # to_empty gives tied modules separate parameters
        return model
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        # The last block's backward comes right after its forward: resharding it would only gather it again.
        fully_shard(block, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    # The root (embeddings, final norm, LM head) is used last in forward and first in backward: keep it unsharded.
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=False)
    assert isinstance(model, FSDPModule)
    # Each block starts gathering the next one's parameters before its own compute, so the all-gather of block
    # i + 1 overlaps block i's forward even when the CPU issues kernels only just ahead of the GPU.
    for block, following in itertools.pairwise(blocks):
        assert isinstance(block, FSDPModule)
        block.set_modules_to_forward_prefetch([following])  # type: ignore[list-item]
    if on_meta:
        # Each rank allocates only its own shards; the caller fills them (init, checkpoint or HF weights).
        model.to_empty(device=ctx.device)
    # Each micro-batch's loss is already divided by the step's global loss-token count, so gradients are summed
    # over ranks, not averaged (a plain sum: gloo has no PREMUL_SUM).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
