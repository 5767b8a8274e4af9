"""The process group and device mesh of a run: one code path for every world size.

A plain `lmforge train` is a process group of one; `torchrun` gives many. CPU runs use gloo; CUDA runs use NCCL
(with gloo for CPU tensors).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.config.parallel import ParallelConfig
from lmforge.parallel.context import ContextShard
from lmforge.parallel.experts import NO_EXPERT_PARALLEL, ExpertShard
from lmforge.parallel.stages import NO_PIPELINE, PipeShard, stage_ranks, stages_per_rank
from lmforge.parallel.tensor import NO_TENSOR_PARALLEL, TensorShard


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
    """FSDP's mesh over all ranks but the TP dimension: 1-D, sharding parameters over every rank (data-parallel and
    context-parallel alike), or with `parallel.dp_replicate` > 1 2-D (replicate, shard): replica groups of
    consecutive ranks, each sharding within itself (HSDP)."""
    cp: ContextShard = field(default_factory=lambda: ContextShard(None, 0, 1))
    """This rank's context-parallel group (size 1 without context parallelism)."""
    ep: ExpertShard = NO_EXPERT_PARALLEL
    """This rank's expert-parallel group (size 1 without expert parallelism): consecutive ranks split the routed
    experts between them."""
    tp: TensorShard = NO_TENSOR_PARALLEL
    """This rank's tensor-parallel group (size 1 without tensor parallelism): consecutive ranks split every matmul
    between them."""
    pp: PipeShard = NO_PIPELINE
    """This rank's pipeline group (size 1 without pipeline parallelism): the outermost dimension, one block of
    world size / pp consecutive ranks per stage group."""

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which rows of a step this rank's CP, TP and pipeline groups train on."""
        return (self.rank % (self.world_size // self.pp.size)) // (self.cp.size * self.tp.size)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: world size / (pp x cp x tp)."""
        return self.world_size // (self.pp.size * self.cp.size * self.tp.size)

    @property
    def counts_tokens(self) -> bool:
        """Whether this rank's token and loss statistics count in the step's sums: the ranks of a TP group all see
        the same tokens, so only the first of each counts them; of a pipeline group, the one computing the loss."""
        return self.tp.rank == 0 and self.pp.holds_loss

    @property
    def counts_rows(self) -> bool:
        """Whether this rank counts whole-row figures (a row's segments) in the step's sums: every rank of a CP, TP
        and pipeline group sees the whole row's segment lengths, so only one of each counts them."""
        return self.counts_tokens and self.cp.rank == 0

    def describe_layout(self) -> str:
        """The ranks as the mesh dimensions they form, outermost first, e.g. `dp 4 (HSDP 2 x 2) x cp 2 x tp 8`;
        under TP each GPU's tokens are its share of its group's."""
        replicas = self.mesh.size(0) if self.mesh.ndim == 2 else 1  # HSDP's mesh is (replicate, shard)
        dp = f"dp {self.dp_size}" + (f" (HSDP {replicas} x {self.dp_size // replicas})" if replicas > 1 else "")
        parts = [f"pp {self.pp.size}"] if self.pp.size > 1 else []
        parts += [dp] + [f"{name} {size}" for name, size in (("cp", self.cp.size), ("tp", self.tp.size)) if size > 1]
        text = " x ".join(parts) + (f" (ep {self.ep.size} across them)" if self.ep.size > 1 else "")
        if self.tp.size > 1:
            text += f"; tokens and FLOPs per GPU are 1/{self.tp.size} of its TP group's"
        return text

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory and the console."""
        return self.rank == 0


def mesh_degrees(parallel: ParallelConfig) -> dict[str, Any]:
    """`init_distributed`'s keyword arguments for the layout `[parallel]` asks for."""
    return {"cp": parallel.cp, "ep": parallel.ep, "dp_replicate": parallel.dp_replicate, "tp": parallel.tp,
            "pp": parallel.pp, "pp_schedule": parallel.pp_schedule,
            "pp_stages_per_rank": stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)}  # fmt: skip


def init_distributed(
    timeout_minutes: float = 30.0,
    cp: int = 1,
    ep: int = 1,
    dp_replicate: int = 1,
    tp: int = 1,
    mesh_device: str | None = None,
    pp: int = 1,
    pp_schedule: str = "1f1b",
    pp_stages_per_rank: int = 1,
) -> DistContext:
    """Start (or join) the process group from torchrun's environment, or as a group of one.

    The ranks form one grid (replicate, shard, cp, tp), tp innermost: with `tp` > 1, consecutive ranks form the
    tensor-parallel groups (put one on a node: its collectives run in every layer); with `cp` > 1, the next
    dimension forms the context-parallel groups; with `dp_replicate` > 1, FSDP's mesh is 2-D (replicate, shard):
    that many groups of consecutive data- and context-parallel ranks (HSDP). FSDP shards over every rank of the
    grid but the TP dimension. With `pp` > 1, the pipeline dimension is outermost: world size / pp consecutive ranks
    hold each stage group, FSDP shards (or HSDP replicates and shards) within it, and `pp_schedule` with
    `pp_stages_per_rank` says which rank runs the loss. With `ep` > 1, consecutive ranks form the expert-parallel
    groups of a 2-D (expert FSDP, ep) mesh, across data- and context-parallel ranks alike.

    `mesh_device` names the device type of the context and its meshes instead of the rank's own: `lmforge plan
    --check-cuda` joins a fake process group with CUDA meshes on a machine without a GPU."""
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
    if mesh_device is not None:
        device = torch.device(mesh_device)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device if use_cuda else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    for name, degree in (("cp", cp), ("tp", tp), ("dp_replicate", dp_replicate)):
        if world % degree:
            raise ValueError(f"parallel.{name} = {degree} does not divide the world size {world}")
    rank = dist.get_rank()
    if pp > 1:
        ctx = _pipeline_context(rank, world, local_rank, device, dp_replicate, cp, tp, pp,
                                stage_ranks(pp, pp_stages_per_rank, pp_schedule)[-1])  # fmt: skip
        if ep > 1:
            ctx.ep = _pipeline_expert_shard(device, world, rank, ep, dp_replicate, pp)
        return ctx
    if tp > 1:
        ctx = _grid_context(rank, world, local_rank, device, cp, dp_replicate, tp)
        if ep > 1:
            ctx.ep = _expert_shard(device, world, rank, ep, dp_replicate)
        return ctx
    if dp_replicate > 1:
        mesh = init_device_mesh(device.type, (dp_replicate, world // dp_replicate),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    shard = ContextShard(None, 0, 1)
    if cp > 1:
        grid = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
        shard = ContextShard(grid.get_group("cp"), rank % cp, cp)
    ctx = DistContext(rank, world, local_rank, device, mesh, shard)
    if ep > 1:
        ctx.ep = _expert_shard(device, world, rank, ep, dp_replicate)
    return ctx


def _expert_shard(device: torch.device, world: int, rank: int, ep: int, dp_replicate: int = 1) -> ExpertShard:
    """This rank's expert-parallel group: consecutive ranks, on a mesh of their own. Expert stacks shard over the
    ranks holding the same experts, whatever the other dimensions; with `dp_replicate` > 1 (HSDP) they do so within
    each replica group and are replicated across the groups, as the dense weights are."""
    if world % ep:
        raise ValueError(f"parallel.ep = {ep} does not divide the world size {world}")
    if (world // dp_replicate) % ep:
        raise ValueError(f"parallel.ep = {ep} does not divide a replica group's {world // dp_replicate} ranks "
                         f"(parallel.dp_replicate = {dp_replicate})")  # fmt: skip
    if dp_replicate == 1:
        grid = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        # Whole stacks are cut first into ep blocks of experts, then each block over its FSDP ranks: the same grid
        # with the ep dimension outermost.
        layout = DeviceMesh(device.type, grid.mesh.T.contiguous(), mesh_dim_names=("ep", "efsdp"))
        return ExpertShard(grid.get_group("ep"), rank % ep, ep, grid["efsdp"], layout)
    shards = world // (dp_replicate * ep)
    grid = init_device_mesh(device.type, (dp_replicate, shards, ep), mesh_dim_names=("ereplicate", "eshard", "ep"))
    layout = DeviceMesh(device.type, grid.mesh.permute(2, 0, 1).contiguous(),
                        mesh_dim_names=("ep", "ereplicate", "eshard"))  # fmt: skip
    return ExpertShard(grid.get_group("ep"), rank % ep, ep, grid["ereplicate", "eshard"], layout)


def _pipeline_expert_shard(
    device: torch.device, world: int, rank: int, ep: int, dp_replicate: int, pp: int
) -> ExpertShard:
    """`_expert_shard` inside each pipeline stage group: a stage's experts exist on its group's ranks only, so the
    expert-parallel groups and the expert stacks' FSDP meshes stay inside it (the layout mesh is the stage group's
    slice of one mesh over all ranks, which every rank builds alike)."""
    inner = world // pp
    if inner % (dp_replicate * ep):
        raise ValueError(f"parallel.ep = {ep} does not divide a stage group's {inner // dp_replicate} ranks "
                         f"(world size / (parallel.pp x dp_replicate))")  # fmt: skip
    shards = inner // (dp_replicate * ep)
    grid = init_device_mesh(device.type, (pp, dp_replicate, shards, ep),
                            mesh_dim_names=("epp", "ereplicate", "eshard", "ep"))  # fmt: skip
    # Whole stacks are cut first into ep blocks of experts, then each block over its FSDP ranks.
    full = DeviceMesh(device.type, grid.mesh.permute(0, 3, 1, 2).contiguous(),
                      mesh_dim_names=("epp", "ep", "ereplicate", "eshard"))  # fmt: skip
    if dp_replicate == 1:
        return ExpertShard(grid.get_group("ep"), rank % ep, ep, grid["eshard"], full["ep", "eshard"])
    return ExpertShard(grid.get_group("ep"), rank % ep, ep, grid["ereplicate", "eshard"],
                       full["ep", "ereplicate", "eshard"])  # fmt: skip


def _grid_context(
    rank: int, world: int, local_rank: int, device: torch.device, cp: int, dp_replicate: int, tp: int
) -> DistContext:
    """The context of a tensor-parallel run: one (replicate, shard, cp, tp) mesh whose sub-meshes FSDP and TP share
    (FSDP2 composes with TP only on sub-meshes of one mesh)."""
    if world % (dp_replicate * cp * tp):
        raise ValueError(f"parallel.dp_replicate x cp x tp = {dp_replicate * cp * tp} does not divide the world size "
                         f"{world}")  # fmt: skip
    shards = world // (dp_replicate * cp * tp)
    grid = init_device_mesh(device.type, (dp_replicate, shards, cp, tp),
                            mesh_dim_names=("replicate", "shard", "cp", "tp"))  # fmt: skip
    mesh, shard = _shard_mesh(grid, dp_replicate, cp)
    return DistContext(rank, world, local_rank, device, mesh, shard,
                       tp=TensorShard(grid["tp"], grid.get_local_rank("tp"), tp))  # fmt: skip


def _shard_mesh(grid: DeviceMesh, dp_replicate: int, cp: int) -> tuple[DeviceMesh, ContextShard]:
    """FSDP's mesh over a grid's (replicate, shard, cp) dimensions (2-D under HSDP, the context-parallel ranks
    sharding too) and this rank's context-parallel group."""
    if dp_replicate > 1:
        grid["shard", "cp"]._flatten("shard_cp")
        mesh = grid["replicate", "shard_cp"]
    else:
        mesh = grid["replicate", "shard", "cp"]._flatten("dp")
    shard = ContextShard(grid.get_group("cp"), grid.get_local_rank("cp"), cp) if cp > 1 else ContextShard(None, 0, 1)
    return mesh, shard


def _pipeline_context(rank: int, world: int, local_rank: int, device: torch.device, dp_replicate: int, cp: int,
                      tp: int, pp: int, loss_rank: int) -> DistContext:  # fmt: skip
    """The context of a pipeline-parallel run: a (pp, replicate, shard, cp, tp) grid whose outer dimension links the
    stages of the same rows and whose inner ones are each stage group's FSDP mesh (2-D under HSDP), its
    context-parallel groups and, innermost, its tensor-parallel groups. The ranks that exchange a stage's hidden
    states hold the same TP rank, so each sends its own share of the sequence-parallel stream."""
    if world % (pp * dp_replicate * cp * tp):
        raise ValueError(f"parallel.pp x dp_replicate x cp x tp = {pp * dp_replicate * cp * tp} does not divide the "
                         f"world size {world}")  # fmt: skip
    grid = init_device_mesh(device.type, (pp, dp_replicate, world // (pp * dp_replicate * cp * tp), cp, tp),
                            mesh_dim_names=("pp", "replicate", "shard", "cp", "tp"))  # fmt: skip
    mesh, context = _shard_mesh(grid, dp_replicate, cp)
    shard = PipeShard(grid.get_group("pp"), grid.get_local_rank("pp"), pp, loss_rank)
    tensor = TensorShard(grid["tp"], grid.get_local_rank("tp"), tp) if tp > 1 else NO_TENSOR_PARALLEL
    return DistContext(rank, world, local_rank, device, mesh, context, tp=tensor, pp=shard)


def shutdown_distributed() -> None:
    """Leave the process group. The barrier first: gloo can abort at exit when a peer is still tearing down."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
