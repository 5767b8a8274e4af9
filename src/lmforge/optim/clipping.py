"""Gradient norms and clipping over optimizer groups, on this rank's gradient shards without a host sync."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch


class Grouped(Protocol):
    """Anything with optimizer parameter groups: a torch optimizer or `Optimizers`."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The groups, each with its `params` (and, for the norms, its `name`)."""
        ...


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of a parameter's gradient (the local shard of a DTensor)."""
    g = p.grad
    if g is None:
        return None
    return g.to_local() if hasattr(g, "to_local") else g


def replicas(p: torch.Tensor) -> int:
    """How many ranks hold the same part of `p`: the sizes of the mesh dimensions a DTensor is replicated along
    (HSDP's replica groups), 1 for a plain tensor or one sharded along every dimension of its mesh."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return 1
    return math.prod(p.device_mesh.size(d) for d, placement in enumerate(placements) if placement.is_replicate())


def group_grad_squares(optimizer: Grouped, device: torch.device) -> dict[str, torch.Tensor]:
    """Per group, the sum of squares of this rank's gradient entries (fp32, on the device, no host sync); summed
    over ranks they give each group's squared gradient norm. A part that several ranks hold (HSDP) counts 1 / its
    replicas on each of them, so it counts once in the sum."""
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        by_replicas: dict[int, list[torch.Tensor]] = {}
        for p in group["params"]:
            g = local_grad(p)
            if g is not None and g.numel():
                by_replicas.setdefault(replicas(p), []).append(g)
        total = torch.zeros((), device=device, dtype=torch.float32)
        for count, grads in by_replicas.items():
            norms = torch._foreach_norm(grads, 2.0)
            squares = torch.stack([n.float() for n in norms]).square().sum()
            total = total + (squares if count == 1 else squares / count)
        out[group["name"]] = total
    return out


@torch.no_grad()
def clip_gradients(optimizer: Grouped, total_norm: float, max_norm: float) -> None:
    """Scale every gradient by max_norm / total_norm when the norm exceeds max_norm (0: no clipping)."""
    if not max_norm or total_norm <= max_norm:
        return
    grads = [g for group in optimizer.param_groups for g in (local_grad(p) for p in group["params"]) if g is not None]
    torch._foreach_mul_(grads, max_norm / (total_norm + 1e-6))
