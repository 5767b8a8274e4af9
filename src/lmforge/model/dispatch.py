"""The order of an MoE block's token copies: sorted by expert for the grouped matmuls (and the expert-parallel
exchange, which the block takes as an `ExpertExchange`), and back."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ExpertExchange = Callable[[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]], Tensor]
"""How routed copies reach experts held by other ranks (expert parallelism, passed in by `lmforge.parallel.experts`):
(copies sorted by expert, copies per routed expert [E], `compute`) -> the copies' outputs in the same order, where
`compute(rows, counts)` runs this rank's experts on rows sorted by local expert, `counts` [E / ep] of each."""


def dispatch_order(indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The (token, slot) pairs of indices [T, k] sorted by expert (stable), and int64 token counts per expert.

    The counts come from scatter_add_, not bincount, which reads the maximum on the host on CUDA.
    """
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def inverse_permutation(order: Tensor) -> Tensor:
    """The permutation that undoes `order` (ys[inverse] puts rows sorted by `order` back in place); an index
    scatter of positions, so gathers stay deterministic on CUDA."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse
