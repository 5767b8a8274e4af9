"""Expert parallelism: routed experts split over a group of ranks, tokens sent to their experts by all-to-all.

Each of the `ep` ranks of an expert-parallel group holds E / ep consecutive experts (rank r: experts
[r E/ep, (r + 1) E/ep)). A rank routes its own tokens as without expert parallelism, sorts the token copies by
expert (so by destination rank, since experts are dealt in blocks), then:

1. one small all-to-all of the per-expert counts tells every rank how many copies it gets from each peer, and for
   which of its experts;
2. the send and receive sizes are read on the host: `all_to_all_single` takes them as Python lists. This is the
   one host read of the dispatch (once per MoE layer and forward), a device sync on CUDA;
3. `all_to_all_single` sends the copies (autograd-aware: backward is the reverse exchange), the rank regroups
   what it received by local expert, runs its experts as grouped matmuls, and the reverse exchange returns each
   copy's output to the rank that routed it, which un-permutes and gate-weights them as without expert parallelism.

Every rank of the group takes part in both exchanges even when it sends or receives no token, so a rank without
tokens for some expert, or an expert without tokens, needs nothing special. The model knows nothing of this:
`shard_experts` keeps each rank's block of experts and passes `ExpertDispatch` in as their `exchange`.

Each rank's stacks are FSDP-sharded along the experts over the ranks that hold the same ones. `global_view`
presents such a tensor (a parameter, or optimizer state shaped like one) as the DTensor of the whole stack it is a
piece of, sharing its storage, so checkpoints (DCP) and pretrained weights see whole stacks: a checkpoint is the
same at every `ep`, resumes at any other, and exports as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lmforge.model.dispatch import inverse_permutation
from lmforge.model.moe import Experts


@dataclass(frozen=True)
class ExpertShard:
    """Where this rank sits in its expert-parallel group."""

    group: dist.ProcessGroup | None
    """The ranks that split the experts between them (None without expert parallelism)."""
    rank: int
    """This rank's index in the group: it holds experts [rank x E/size, (rank + 1) x E/size)."""
    size: int
    """Ranks in the group (`parallel.ep`)."""
    fsdp_mesh: DeviceMesh | None = None
    """The mesh FSDP shards this rank's experts over: the ranks holding the same experts, one per group; 2-D
    (replicate, shard) under HSDP, whose replica groups each hold a copy."""
    layout: DeviceMesh | None = None
    """The (ep, expert FSDP...) mesh that places this rank's rows of an expert stack in the whole stack, as
    checkpoints hold it."""


NO_EXPERT_PARALLEL = ExpertShard(None, 0, 1)
"""The layout of a run without expert parallelism: every rank holds every expert."""


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of the rows of x [N, ...]: rows [sum(send[:d]), sum(send[:d+1])) go to rank d, and
    `recv[s]` rows come from rank s. Backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
    """Exchange the rows of x with the group's ranks (see `_AllToAll`); differentiable."""
    return _AllToAll.apply(x, recv, send, group)


@dataclass
class Exchange:
    """One dispatch's plan: the sizes of both exchanges and how the received copies regroup by local expert."""

    send: list[int]
    """Copies sent to each rank of the group (host ints)."""
    recv: list[int]
    """Copies received from each rank of the group (host ints)."""
    local_order: Tensor
    """Received rows sorted by local expert (stable: by source rank within an expert)."""
    local_counts: Tensor
    """int64 [E / ep]: copies each local expert computes."""


def plan_exchange(counts: Tensor, shard: ExpertShard) -> Exchange:
    """The exchange sizes for a rank whose sorted copies per (global) expert are `counts` [E]: one all-to-all of
    the counts, then the one host read of the dispatch."""
    assert shard.group is not None
    local = counts.numel() // shard.size
    received = torch.empty_like(counts)
    # Rank d gets counts[d E/ep : (d + 1) E/ep]; received[s E/ep + j] is what rank s sends to local expert j.
    dist.all_to_all_single(received, counts, group=shard.group)
    by_source = received.view(shard.size, local)
    send, recv = torch.stack([counts.view(shard.size, local).sum(1), by_source.sum(1)]).tolist()
    total = sum(recv)
    experts = torch.arange(local, device=counts.device).repeat(shard.size)
    expert_of_row = torch.repeat_interleave(experts, received, output_size=total)
    local_order = torch.argsort(expert_of_row, stable=True)
    return Exchange(send, recv, local_order, by_source.sum(0))


@dataclass(frozen=True)
class ExpertDispatch:
    """The `exchange` of a rank's routed experts under expert parallelism (see the module docstring)."""

    shard: ExpertShard
    """This rank's expert-parallel group."""

    def sizes(self, counts: Tensor, rows: int) -> Exchange:
        """The exchange of `rows` sorted copies whose routed counts per expert are `counts` (`plan_exchange`)."""
        return plan_exchange(counts, self.shard)

    # Outside compiled graphs: the exchange sizes are host ints, read from the device.
    @torch.compiler.disable
    def __call__(self, xs: Tensor, counts: Tensor, compute: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """Copies `xs` sorted by expert (routed ones first, null ones after them), `counts` [E] routed copies per
        expert -> their outputs in the same order; `compute(rows, local_counts)` runs this rank's experts."""
        plan = self.sizes(counts, xs.shape[0])
        group = self.shard.group
        assert group is not None
        sent = sum(plan.send)  # the routed copies; null ones sort after them and stay here
        received = all_to_all(xs[:sent], plan.recv, plan.send, group)
        ys = compute(received[plan.local_order], plan.local_counts)
        back = all_to_all(ys[inverse_permutation(plan.local_order)], plan.send, plan.recv, group)
        return torch.cat([back, back.new_zeros(xs.shape[0] - sent, back.shape[-1])]) if sent < xs.shape[0] else back


def expert_modules(model: nn.Module) -> list[Experts]:
    """The routed-expert modules of `model` (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, Experts)]


def shard_experts(model: nn.Module, shard: ExpertShard) -> list[Experts]:
    """Keep only this rank's block of experts in every routed-expert module and pass the dispatch in; returns the
    modules."""
    modules = expert_modules(model)
    for experts in modules:
        if experts.num_experts % shard.size:
            raise ValueError(f"{experts.num_experts} experts do not split over parallel.ep = {shard.size} ranks")
        local = experts.num_experts // shard.size
        experts.keep_experts(shard.rank * local, local)
        experts.exchange = ExpertDispatch(shard)
    return modules


def _layout_of(model: nn.Module) -> ExpertShard | None:
    for module in expert_modules(model):
        if isinstance(module.exchange, ExpertDispatch):
            return module.exchange.shard
    return None


def global_view(state: Any, model: nn.Module) -> Any:
    """A state dict (nested dicts and lists, as DCP takes) in which every tensor sharded like one of this rank's
    expert stacks is the DTensor of the whole stack, over the same storage; `state` itself when `model` has no
    expert parallelism. Loading into the view loads the live tensors."""
    shard = _layout_of(model)
    if shard is None:
        return state
    return _rewrap(state, shard)


def _rewrap(state: Any, shard: ExpertShard) -> Any:
    if isinstance(state, dict):
        return {k: _rewrap(v, shard) for k, v in state.items()}
    if isinstance(state, list):
        return [_rewrap(v, shard) for v in state]
    # Only expert modules are sharded over the expert FSDP mesh: their stacks [E/ep, ...] and stacked biases.
    if isinstance(state, DTensor) and state.device_mesh == shard.fsdp_mesh and state.ndim >= 2:
        return _whole_stack(state, shard)
    return state


def _whole_stack(t: DTensor, shard: ExpertShard) -> Tensor:
    # FSDP's Shard(0) along the experts, after HSDP's Replicate when the stacks are replicated over replica groups
    if t.placements[-1] != Shard(0) or not all(p.is_replicate() for p in t.placements[:-1]):
        raise ValueError(f"expert stacks must be sharded along the experts, got {t.placements}")
    assert shard.layout is not None
    shape = (t.shape[0] * shard.size, *t.shape[1:])
    return DTensor.from_local(
        t.to_local(), shard.layout, (Shard(0), *t.placements), run_check=False, shape=shape, stride=t.stride()
    )
