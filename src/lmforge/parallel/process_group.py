"""The process group and device mesh of a run: one code path for every world size.

A plain `lmforge train` is a process group of one; `torchrun` gives many. CPU runs use gloo; CUDA runs use NCCL
(with gloo for CPU tensors).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.parallel.context import ContextShard
from lmforge.parallel.experts import NO_EXPERT_PARALLEL, ExpertShard


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
    """FSDP's mesh over all ranks: 1-D, sharding parameters over every rank (data-parallel and context-parallel
    alike), or with `parallel.dp_replicate` > 1 2-D (replicate, shard): replica groups of consecutive ranks, each
    sharding within itself (HSDP)."""
    cp: ContextShard = field(default_factory=lambda: ContextShard(None, 0, 1))
    """This rank's context-parallel group (size 1 without context parallelism)."""
    ep: ExpertShard = NO_EXPERT_PARALLEL
    """This rank's expert-parallel group (size 1 without expert parallelism): consecutive ranks split the routed
    experts between them."""

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which rows of a step this rank's CP group trains on."""
        return self.rank // self.cp.size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: world size / cp."""
        return self.world_size // self.cp.size

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory and the console."""
        return self.rank == 0


def init_distributed(timeout_minutes: float = 30.0, cp: int = 1, ep: int = 1, dp_replicate: int = 1) -> DistContext:
    """Start (or join) the process group from torchrun's environment, or as a group of one. With `cp` > 1,
    consecutive ranks form the context-parallel groups of a 2-D (dp, cp) device mesh; with `ep` > 1, consecutive
    ranks form the expert-parallel groups of a 2-D (expert FSDP, ep) mesh, across data- and context-parallel
    ranks alike; with `dp_replicate` > 1, FSDP's mesh is 2-D (replicate, shard): that many groups of consecutive
    ranks (HSDP)."""
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
    if world % cp:
        raise ValueError(f"parallel.cp = {cp} does not divide the world size {world}")
    if world % dp_replicate:
        raise ValueError(f"parallel.dp_replicate = {dp_replicate} does not divide the world size {world}")
    if dp_replicate > 1:
        mesh = init_device_mesh(device.type, (dp_replicate, world // dp_replicate),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    shard = ContextShard(None, 0, 1)
    if cp > 1:
        grid = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
        shard = ContextShard(grid.get_group("cp"), rank % cp, cp)
    ctx = DistContext(rank, world, local_rank, device, mesh, shard)
    if ep > 1:
        if world % ep:
            raise ValueError(f"parallel.ep = {ep} does not divide the world size {world}")
        grid = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        # Whole stacks are cut first into ep blocks of experts, then each block over its FSDP ranks: the same grid
        # with the ep dimension outermost.
        layout = DeviceMesh(device.type, grid.mesh.T.contiguous(), mesh_dim_names=("ep", "efsdp"))
        ctx.ep = ExpertShard(grid.get_group("ep"), rank % ep, ep, grid["efsdp"], layout)
    return ctx


def shutdown_distributed() -> None:
    """Leave the process group. The barrier first: gloo can abort at exit when a peer is still tearing down."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
