"""Log-likelihood requests packed into scoring rows and scored with the training model.

Each request is one segment (attention and positions restart there): its tokens are the context then the
continuation, inputs tokens[:-1], targets tokens[1:], and only the continuation's targets are scored. Requests are
packed greedily in order into rows of exactly `row_tokens` positions, closed by an unscored padding segment, so
compiled blocks see one shape. Every row keeps which request each of its positions scores.

Rows are dealt round-robin to the ranks (row i to rank i % world_size) and every rank runs the same number of
forward passes, since FSDP gathers parameters in each. The model runs under `torch.no_grad` in eval mode and gives
each position's log-probability with the LM head and softmax in fp32, in chunks of its `loss_chunk_tokens` (1024
when unset), never holding the full logits; they are summed per request in float64 on the device and all-reduced
once, so the result does not depend on the world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmforge.data.batch import MicroBatch, Window, pack_windows, padding_window
from lmforge.data.packing import fill_bins
from lmforge.eval.sets import Request


@dataclass(frozen=True)
class ScoringRow:
    """One forward pass of packed requests."""

    batch: MicroBatch
    """The micro-batch (see `lmforge.data.batch`), on the CPU."""
    request_ids: np.ndarray
    """int64 [row_tokens]: the request each position's target belongs to, -1 where nothing is scored."""


def request_window(request: Request) -> Window:
    """A request as one segment whose loss mask covers the continuation's targets only."""
    tokens = request.tokens
    mask = np.zeros(len(tokens) - 1, dtype=bool)
    mask[len(request.context) - 1 :] = True
    return Window(tokens, [len(tokens) - 1], mask)


def pack_requests(requests: Sequence[Request], row_tokens: int) -> list[ScoringRow]:
    """The requests packed greedily in order into rows of exactly `row_tokens` positions (see the module)."""
    lengths = [len(r.context) + len(r.continuation) - 1 for r in requests]
    for r, n in zip(requests, lengths, strict=True):
        if n > row_tokens:
            raise ValueError(
                f"request (item {r.item}, choice {r.choice}) needs {n} positions, more than a scoring row's "
                f"{row_tokens}: lower the context length or raise the row size"
            )
    rows: list[ScoringRow] = []
    for members in fill_bins(lengths, row_tokens):
        windows = [request_window(requests[k]) for k in members]
        ids = [np.where(w.loss_mask, k, -1) for k, w in zip(members, windows, strict=True)]
        used = sum(lengths[k] for k in members)
        if used < row_tokens:
            windows.append(padding_window(row_tokens - used))
            ids.append(np.full(row_tokens - used, -1))
        rows.append(ScoringRow(pack_windows(windows), np.concatenate(ids).astype(np.int64)))
    return rows


@torch.no_grad()
def score_requests(
    model: nn.Module,
    rows: Sequence[ScoringRow],
    n_requests: int,
    device: torch.device,
    rank: int,
    world_size: int,
    counted: bool = True,
) -> np.ndarray:
    """float64 [n_requests]: each request's summed log-likelihood, the same on every rank. A rank whose rows
    another rank counts (`counted` False: the other ranks of a TP group) adds nothing to the sums.

    The model gives each position's cross-entropy with the LM head and softmax in fp32, chunk by chunk
    (`CausalLM.forward(..., per_token=True)`); the whole model is called (not its parts) so that FSDP2 gathers the
    LM head as in training. Training mode is restored afterwards.
    """
    totals = request_loglik_sums(model, rows, n_requests, device, rank, world_size)
    if not counted:
        totals.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return totals[:n_requests].cpu().numpy()


def request_loglik_sums(
    model: nn.Module, rows: Sequence[ScoringRow], n_requests: int, device: torch.device, rank: int, world_size: int
) -> Tensor:
    """This rank's share of `score_requests`, before the reduction: float64 [n_requests + 1] on the device (the last
    slot collects the unscored positions). Nothing is read on the host."""
    was_training = model.training
    model.eval()
    # One slot more than there are requests: unscored positions add into it, so no masking (a host sync) is needed.
    totals = torch.zeros(n_requests + 1, dtype=torch.float64, device=device)
    try:
        for turn in range(math.ceil(len(rows) / world_size)):
            i = turn * world_size + rank
            # A rank without a row of its own this turn scores row 0 and discards it: the forwards must match.
            own = i < len(rows)
            row = rows[i if own else 0]
            mb = row.batch.to(device)
            ce = model(mb.input_ids, mb.position_ids, mb.doc_lens, targets=mb.target_ids, per_token=True)
            if not own:
                continue
            slots = torch.from_numpy(row.request_ids).to(device)
            slots = torch.where(slots >= 0, slots, n_requests)
            totals.index_add_(0, slots, -ce.double())
    finally:
        model.train(was_training)
    return totals
