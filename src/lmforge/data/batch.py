"""The micro-batch contract, and how a step's windows are dealt to ranks and micro-batches.

Every data type yields micro-batches of the same form, a `MicroBatch` of 1-row tensors of length T (docs/data.md).
Attention and positions restart at every document (segment) of the row.

Micro-batches are built in the data worker thread, so everything here is numpy, wrapped with `torch.from_numpy`
at the end: a torch compute op in that thread would start a second OpenMP team, after which the trainer's compute
threads sleep between parallel regions (measured: 0.3 s more per step on 2 cores, see docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass worth of packed tokens: a row of T tokens holding one or more documents."""

    input_ids: Tensor
    """int64 [1, T]: the tokens."""
    target_ids: Tensor
    """int64 [1, T]: the next tokens (already shifted)."""
    position_ids: Tensor
    """int64 [1, T]: positions, restarting at 0 at every document."""
    loss_mask: Tensor
    """bool [1, T]: which targets count (all of them for pretraining)."""
    doc_lens: Tensor
    """int32 [S]: the lengths of the row's documents (segments) in order, adding up to T; attention never crosses
    from one into another. Not `data.seq_len`, the window length: with document masking a window holds several
    documents, and a document cut by a window boundary continues as the next window's first. Kept on the host: the
    model reads the values to build its attention mask, which costs no device read there."""
    source_tokens: Tensor | None = None
    """int64 [sources]: the row's target tokens per source of a mixture's pool (`lmforge mix`); None elsewhere."""

    PER_TOKEN = ("input_ids", "target_ids", "position_ids", "loss_mask")
    """The fields with one entry per token of the row."""

    @property
    def tokens(self) -> int:
        """T, the row's length."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """This micro-batch with its tensors on `device`, except `doc_lens`, which stays on the host."""
        moved = {f.name: _moved(getattr(self, f.name), device, non_blocking) for f in fields(self)
                 if f.name != "doc_lens"}  # fmt: skip
        return MicroBatch(**moved, doc_lens=self.doc_lens)

    def pin_memory(self) -> MicroBatch:
        """This micro-batch in page-locked host memory (faster, asynchronous copies to a GPU)."""
        return MicroBatch(**{f.name: _moved(getattr(self, f.name), None, False) for f in fields(self)})


def _moved(t: Tensor | None, device: torch.device | str | None, non_blocking: bool) -> Tensor | None:
    """`t` on `device` (pinned when `device` is None); None stays None."""
    if t is None:
        return None
    return t.pin_memory() if device is None else t.to(device, non_blocking=non_blocking)


@dataclass(frozen=True)
class Window:
    """`seq_len + 1` consecutive tokens and how their first `seq_len` positions split into segments."""

    tokens: np.ndarray
    """seq_len + 1 token ids: inputs are tokens[:-1], targets tokens[1:]."""
    seg_lens: Sequence[int]
    """Segment lengths over the seq_len input positions (one per document, or [seq_len])."""
    loss_mask: np.ndarray | None = None
    """Optional bool mask over the seq_len targets; None means every target counts."""
    source_tokens: np.ndarray | None = None
    """Optional int64 count of the seq_len targets per source of the pool (see `lmforge.data.sources`)."""


def segments_from_doc_starts(starts: Sequence[int], seq_len: int) -> list[int]:
    """Segment lengths of a window whose documents begin at the given input positions (0 < start < seq_len)."""
    cuts = [0, *sorted(s for s in starts if 0 < s < seq_len), seq_len]
    return [b - a for a, b in itertools.pairwise(cuts) if b > a]


def padding_window(n: int) -> Window:
    """`n` unscored positions as a segment of their own: fills a micro-batch up to its fixed length."""
    return Window(np.zeros(n + 1, dtype=np.int64), [n], np.zeros(n, dtype=bool))


def pack_windows(windows: Sequence[Window]) -> MicroBatch:
    """Concatenate windows into one micro-batch; each window's segments stay separate segments."""
    if not windows:
        raise ValueError("a micro-batch needs at least one window")
    inputs, targets, masks, doc_lens = [], [], [], []
    sources = [w.source_tokens for w in windows if w.source_tokens is not None]
    for w in windows:
        n = len(w.tokens) - 1
        if sum(w.seg_lens) != n:
            raise ValueError(f"window segments add up to {sum(w.seg_lens)}, expected {n}")
        inputs.append(w.tokens[:-1])
        targets.append(w.tokens[1:])
        masks.append(np.ones(n, dtype=bool) if w.loss_mask is None else w.loss_mask)
        doc_lens.extend(int(s) for s in w.seg_lens)
    lens = np.asarray(doc_lens, dtype=np.int32)
    return MicroBatch(
        input_ids=_row(np.concatenate(inputs).astype(np.int64)),
        target_ids=_row(np.concatenate(targets).astype(np.int64)),
        position_ids=_row(positions_from_doc_lens(lens)),
        loss_mask=_row(np.concatenate(masks).astype(bool)),
        doc_lens=torch.from_numpy(lens),
        source_tokens=torch.from_numpy(np.sum(sources, axis=0, dtype=np.int64)) if sources else None,
    )


def _row(values: np.ndarray) -> Tensor:
    return torch.from_numpy(values).unsqueeze(0)


def positions_from_doc_lens(doc_lens: np.ndarray) -> np.ndarray:
    """int64 positions that restart at 0 at every document."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return np.arange(int(lens.sum()), dtype=np.int64) - starts


def null_micro_batch(like: MicroBatch) -> MicroBatch:
    """A micro-batch of the same shape whose loss mask is empty: it adds exactly zero to the gradient."""
    t = like.tokens
    zeros = torch.zeros(1, t, dtype=torch.int64)
    return MicroBatch(
        input_ids=zeros,
        target_ids=zeros.clone(),
        position_ids=torch.arange(t, dtype=torch.int64).unsqueeze(0),
        loss_mask=torch.zeros(1, t, dtype=torch.bool),
        doc_lens=torch.tensor([t], dtype=torch.int32),
    )


@dataclass(frozen=True)
class StepLayout:
    """How one optimizer step's windows are dealt: per step, per rank, per micro-batch."""

    windows_per_step: int
    """Windows consumed by one optimizer step over all ranks."""
    windows_per_micro_batch: int
    """Windows packed into one micro-batch."""
    rank: int
    """This rank."""
    world_size: int
    """Number of ranks."""

    @classmethod
    def from_tokens(
        cls, seq_len: int, batch_tokens: int, micro_batch_tokens: int, rank: int, world_size: int
    ) -> StepLayout:
        """The layout of a config whose sizes are in tokens (checked by the config loader)."""
        return cls(batch_tokens // seq_len, micro_batch_tokens // seq_len, rank, world_size)

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient accumulation steps on each rank."""
        return self.windows_per_step // (self.windows_per_micro_batch * self.world_size)

    def rank_windows(self, first_window: int) -> range:
        """Global indices of this rank's windows in the step that starts at global window `first_window`.

        Ranks take contiguous slices of the step's windows, so the windows a global step trains on do not depend
        on the world size.
        """
        per_rank = self.windows_per_step // self.world_size
        start = first_window + self.rank * per_rank
        return range(start, start + per_rank)

    def split(self, indices: Sequence[int]) -> list[Sequence[int]]:
        """Cut a rank's windows into micro-batches."""
        k = self.windows_per_micro_batch
        return [indices[i : i + k] for i in range(0, len(indices), k)]
