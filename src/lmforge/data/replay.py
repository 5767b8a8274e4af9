"""What a step trained on, rebuilt in one process: its micro-batches and the documents in each.

A step's data depends only on the data config, the seed and the stream position where the step began, never on the
number of ranks (`lmforge.data.tokens`, `lmforge.data.sft`). Given the position of an earlier step (a checkpoint's
saved data state, or the start of the run), the stream is moved on to the step and the step's micro-batches are built
in their global order: micro-batch `i` of a step that ran on `R` data-parallel ranks was the `i mod (M / R)`-th of
rank `i // (M / R)`, where M is the step's micro-batch count.

Each micro-batch is described row by row: a window of the token pool (pretraining) or the packed samples (SFT), and
in it each document's part, where it comes from, its token span, whether the window cut it, and how many of its
tokens are loss targets. A document owns the targets that are its own tokens, so the loss-token counts of a step's
documents add up to the step's `loss/tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.base import StepData
from lmforge.data.batch import MicroBatch
from lmforge.data.batch_hash import micro_batch_hash
from lmforge.data.sft import SFTData
from lmforge.data.shards import ShardError
from lmforge.data.tokens import TokenData


class ReplayError(ValueError):
    """A step that cannot be replayed (a data type without a fixed stream, a step past the data); the message says
    why."""


@dataclass(frozen=True)
class Piece:
    """One document's part of a row."""

    where: str
    """Where the document is: `FILE doc K` for token shards (K counts the file's documents from 0), `FILE line N` or
    `FILE row N` for SFT rows."""
    source: str | None
    """The mixture source of the document (from the folder's `mix.json`), None outside mixtures and for SFT."""
    start: int
    """First token of the part, as a position in its row (a window's positions run 0..seq_len)."""
    token_ids: np.ndarray
    """The part's token ids."""
    loss: np.ndarray
    """bool per token of the part: whether it is a target that counts toward the loss."""
    cut_before: bool
    """The document began before the row (the window's edge cut it)."""
    cut_after: bool
    """The document goes on past the row (cut at the window's edge, or an SFT sample truncated to seq_len + 1)."""

    @property
    def loss_tokens(self) -> int:
        """Targets of the part that count toward the loss."""
        return int(self.loss.sum())


@dataclass(frozen=True)
class Row:
    """A window of the token pool, or an SFT micro-batch's packed samples, with the documents in it."""

    label: str
    """What the row is, e.g. `window 41 (epoch 0, pool offset 5248)` or `packed samples`."""
    offset: int
    """The micro-batch position of the row's token 0: token t > 0 of the row is the target of position
    offset + t - 1."""
    pieces: list[Piece]
    """Its documents' parts, in order."""


@dataclass(frozen=True)
class ReplayedBatch:
    """One micro-batch of a replayed step."""

    index: int
    """Its global index in the step (see the module docstring)."""
    batch: MicroBatch
    """The micro-batch, as the trainer received it."""
    rows: list[Row]
    """What it holds."""

    @property
    def hash(self) -> int:
        """The micro-batch's hash (`lmforge.data.batch_hash`)."""
        return micro_batch_hash(self.batch)


def seek(stream: StepData, position: dict[str, Any] | None, steps: int) -> None:
    """Move a one-process stream to a saved `position` (None: the start of the run), then past `steps` more steps."""
    if not isinstance(stream, TokenData | SFTData):
        raise ReplayError("data.type = 'fake' draws no documents: there is nothing to replay")
    if position is not None:
        stream.load_state_dict(position)
    try:
        stream.skip_steps(steps)
    except ShardError as e:
        raise ReplayError(str(e)) from None


def replay_next_step(stream: StepData) -> list[ReplayedBatch]:
    """The next step of a one-process stream (made with rank 0 of 1), micro-batch by micro-batch, with its
    documents; moves the stream past it."""
    if isinstance(stream, TokenData):
        return _token_step(stream)
    if isinstance(stream, SFTData):
        return _sft_step(stream)
    raise ReplayError("data.type = 'fake' draws no documents: there is nothing to replay")


def _token_step(data: TokenData) -> list[ReplayedBatch]:
    first = data.windows_done
    try:
        batches = data.next_step()
    except ShardError as e:
        raise ReplayError(str(e)) from None
    chunks = data.layout.split(range(first, first + data.layout.windows_per_step))
    seq_len = data.cfg.seq_len
    return [ReplayedBatch(i, mb, [_window_row(data, g, w * seq_len) for w, g in enumerate(chunk)])
            for i, (mb, chunk) in enumerate(zip(batches, chunks, strict=True))]  # fmt: skip


def _window_row(data: TokenData, global_window: int, offset: int) -> Row:
    """The documents of one window, tokens [start, start + seq_len] of the pool, at micro-batch position `offset`."""
    pool, length = data.pool, data.cfg.seq_len + 1
    start = data.window_start(global_window)
    end = start + length
    tokens, _, loss = pool.read(start, length)
    # Targets are the window's tokens 1..seq_len; the first token is input only.
    counts = np.ones(length, dtype=bool) if loss is None else loss.astype(bool)
    counts[0] = False
    pieces = []
    i = int(np.searchsorted(pool.starts, start, side="right")) - 1
    while i < len(pool.files) and int(pool.starts[i]) < end:
        f, base = pool.files[i], int(pool.starts[i])
        lo, hi = max(start - base, 0), min(end - base, f.num_tokens)
        k0 = int(np.searchsorted(f.doc_ends, np.uint64(lo), side="right"))
        k1 = int(np.searchsorted(f.doc_ends, np.uint64(hi - 1), side="right"))
        for k in range(k0, k1 + 1):
            doc_lo = int(f.doc_ends[k - 1]) if k else 0
            doc_hi = int(f.doc_ends[k])
            a, b = max(doc_lo, lo) + base - start, min(doc_hi, hi) + base - start
            pieces.append(Piece(
                where=f"{f.path} doc {k}",
                source=data.sources.source_of(i, k) if data.sources is not None else None,
                start=a,
                token_ids=tokens[a:b],
                loss=counts[a:b],
                cut_before=doc_lo < lo,
                cut_after=doc_hi > hi,
            ))  # fmt: skip
        i += 1
    epoch, index = data.position(global_window)
    return Row(f"window {global_window} (epoch {epoch}, #{index} of the epoch, pool offset {start})", offset, pieces)


def _sft_step(data: SFTData) -> list[ReplayedBatch]:
    samples = data.samples
    out = []
    for i, sample_ids in enumerate(data.next_bins()):
        pieces, at = [], 0
        for s in sample_ids:
            ids, loss = samples.sample(s)
            # Token 0 of a sample is never a target (`lmforge.data.packing.sample_window`).
            counts = loss.astype(bool).copy()
            counts[0] = False
            pieces.append(Piece(samples.where(s), None, at, ids, counts, False, bool(samples.truncated[s])))
            at += len(ids) - 1
        row = Row(f"{len(sample_ids)} packed samples, {data.capacity - at} padding positions", 0, pieces)
        out.append(ReplayedBatch(i, samples.micro_batch(sample_ids, data.capacity), [row]))
    return out


def _shard_document(data: TokenData, file: str, index: int) -> tuple[int, int, int]:
    """(file number in the pool, first pool offset, end pool offset) of document `index` of shard `file`."""
    wanted = Path(file).resolve()
    found = [i for i, f in enumerate(data.pool.files) if f.path.resolve() == wanted]
    if not found:
        raise ReplayError(f"{file} is not a shard of data.paths {list(data.cfg.paths)}")
    f, base = data.pool.files[found[0]], int(data.pool.starts[found[0]])
    if not 0 <= index < f.num_docs:
        raise ReplayError(f"{file} holds documents 0..{f.num_docs - 1}, not {index}")
    return found[0], base + (int(f.doc_ends[index - 1]) if index else 0), base + int(f.doc_ends[index])


def document_source(data: TokenData, file: str, index: int) -> str | None:
    """The mixture source of document `index` of shard `file` (None outside mixtures)."""
    number, _, _ = _shard_document(data, file, index)
    return data.sources.source_of(number, index) if data.sources is not None else None


def document_windows(data: TokenData, file: str, index: int, windows: int) -> list[int]:
    """The global numbers, below `windows`, of the windows with a target among the tokens of document `index` of
    the pool's shard `file` (a path as `Piece.where` names it), in order."""
    _, a, b = _shard_document(data, file, index)
    seq_len, out = data.cfg.seq_len, []
    last_epoch = min(data.position(windows - 1)[0], data.cfg.max_epochs - 1) if windows else -1
    for epoch in range(last_epoch + 1):
        offset, order = data.epoch_order(epoch)
        # Window j of the epoch starts at s = offset + j * seq_len and has targets s + 1 .. s + seq_len: it trains
        # on the document when s lies in [a - seq_len, b - 2].
        lo = max(0, -(-(a - seq_len - offset) // seq_len))
        hi = min(len(order) - 1, (b - 2 - offset) // seq_len)
        for j in range(lo, hi + 1):
            g = data.epoch_start(epoch) + int(np.flatnonzero(order == j)[0])
            if g < windows:
                out.append(g)
    return sorted(out)
