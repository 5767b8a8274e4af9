"""The sequence-wise balance loss (DeepSeek-V3's complementary loss) of one segment of T tokens is
sum_i f_i P_i, with f_i = E / (k T) x (tokens of the segment that chose expert i) and P_i the mean over the
segment's tokens of expert i's score normalized over experts. It reaches the router through the block's output: an
autograd function passes the output through unchanged and, in backward, gives the block's summed loss the gradient
`aux_scale` (set by the trainer each step to coeff / segments in the step), so the training objective gains
coeff x the mean segment loss without another term in the model's return value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from lmforge.model.moe import Routing


@dataclass(frozen=True)
class TokenSplit:
    """Which tokens of a row an MoE block sees when the row is split over ranks: context parallelism cuts it into
    `chunks` equal chunks and gives this rank the chunks `mine`; tensor parallelism then splits those tokens into
    `runs` equal runs of consecutive tokens, this rank's block seeing run `run`."""

    groups: tuple[ProcessGroup, ...]
    """The groups whose ranks hold the row's other tokens (the CP group, the TP group): summing over each in turn
    sums over the whole row."""
    chunks: int = 1
    """Equal chunks the row is cut into (2 x cp under context parallelism)."""
    mine: tuple[int, ...] = (0,)
    """This rank's chunks, in the order it holds them."""
    run: int = 0
    """Which run of its chunks' tokens this rank's block sees."""
    runs: int = 1
    """Runs its chunks' tokens are split into (tp)."""

    def positions(self, total: int, device: torch.device) -> Tensor:
        """Row positions of the tokens this rank's block sees, in a row of `total` tokens (made on `device`)."""
        size = total // self.chunks
        held = torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.mine])
        return held.view(self.runs, -1)[self.run]


def seq_balance_loss(
    routing: Routing, doc_ids: Tensor, cu_seqlens: Tensor, num_experts: int, split: TokenSplit | None = None
) -> Tensor:
    """Sum over the row's segments of DeepSeek-V3's sequence-wise balance loss sum_i f_i P_i (see the module
    docstring); differentiable through the scores (P), not through the choices (f).

    With `split`, `routing` covers this rank's tokens of the row only: the choices are summed over the row's ranks
    (an all-reduce per group, no gradient), so f is the whole segment's, and the result is this rank's part of the
    loss, sum_i f_i times its own tokens' share of P_i. The parts add up to the row's loss over its ranks, and each
    part's gradient is the loss's gradient through this rank's scores, because the loss is linear in P."""
    t, k = routing.indices.shape
    segments = cu_seqlens.shape[0] - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).float().unsqueeze(1)
    seg = doc_ids.long()
    if split is not None:
        seg = seg[split.positions(seg.shape[0], seg.device)]
    probs = routing.scores / routing.scores.sum(-1, keepdim=True)
    p = torch.zeros(segments, num_experts, device=probs.device, dtype=torch.float32).index_add_(0, seg, probs) / lens
    flat = (seg.unsqueeze(1) * num_experts + routing.indices).reshape(-1)
    hits = torch.zeros(segments * num_experts, device=probs.device, dtype=torch.float32)
    hits = hits.index_add_(0, flat, torch.ones(t * k, device=probs.device, dtype=torch.float32))
    if split is not None:
        for group in split.groups:
            hits = funcol.all_reduce(hits, "sum", group)
    f = hits.view(segments, num_experts) * (num_experts / k) / lens
    return (f * p).sum()
