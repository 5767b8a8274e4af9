"""Per-segment causal attention on the CPU, on PyTorch's CPU flash kernel, with a backward of its own.

`sdpa_loop` on the CPU runs here. A packed row [T, heads, dim] holds segments; consecutive segments of one length
form a run, and each run is one batched kernel call ([count, heads, length, dim] views of the row, no copy). Two
things make this faster than calling `F.scaled_dot_product_attention` per run and leaving the rest to autograd:

- **The backward writes into the row's gradients.** Through autograd, every run's slice of q, k and v gets a
  zero-filled gradient of the whole row, and the outputs' concatenation a split, so a row of S segments costs S
  full-size zero fills and additions per tensor. Here the forward keeps the kernel's log-sum-exp per call and
  joins the calls' outputs into the row (a view when the row is one call); the backward calls the kernel's backward
  per call and joins its gradients the same way.
- **Causal calls skip most masked scores** (`CPU_SPLIT_LENGTHS`, `CPU_SPLIT_ROWS`): the kernel takes keys in blocks
  of 512, so for a segment shorter than 768 it scores the whole L x L square although causal attention needs only
  its lower half. A segment of a split length runs as calls of about 64 queries each, call i over the keys up to
  its last query: the first with the kernel's causal mask, the others with the segment's causal mask added to
  their scores. At L = 512 that computes 56% of the square instead of all of it.

The kernel calls are PyTorch's own: `aten::_scaled_dot_product_flash_attention_for_cpu` and its backward, the pair
`F.scaled_dot_product_attention` dispatches to on the CPU. They take grouped-query attention as it is (fewer
key/value heads than query heads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

CPU_SPLIT_LENGTHS = (192, 768)
"""Causal segments of length L with 192 <= L < 768 run as several kernel calls (see the module docstring). Below
768 queries the kernel takes keys in blocks of 512, so at such L it computes the whole L x L score square. Measured
with `benchmarks/causal_split.py` (docs/benchmarks.md): splitting gains from 192 up to 767; below 192 the extra
calls cost more than they save, and from 768 on the kernel's own query blocks (256 rows) already skip most of the
masked blocks."""

CPU_SPLIT_ROWS = 64
"""Queries per call of a split segment: L / 64 calls (rounded), call i over the first (i + 1) / n of the keys, so
the scores computed approach the causal half. 64 was the fastest of 32, 48, 64, 96 and 128 rows at most lengths
(0.76x one call's time at L = 512, forward and backward, against 0.85x for two calls)."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class Piece:
    """One kernel call of a run: queries [rows) of each segment over its first `keys` keys."""

    rows: slice
    keys: int
    causal: bool
    """True: the kernel's own causal mask, aligned to the top left (query i sees keys <= i: the first piece). False:
    the causal mask of the segment's positions (`mask`), which the kernel adds to the scores."""

    def mask(self, dtype: torch.dtype) -> Tensor | None:
        """The additive mask of a piece that is not `causal` (query rows.start + i sees keys <= rows.start + i), in
        the queries' dtype as the kernel requires: a view of one cached [767, 767] causal mask."""
        return None if self.causal else _causal_mask(dtype)[self.rows, : self.keys]


@functools.cache
def _causal_mask(dtype: torch.dtype) -> Tensor:
    """0 where query i may see key j (j <= i), -inf elsewhere, for every position a split segment has."""
    size = CPU_SPLIT_LENGTHS[1] - 1
    seen = torch.ones(size, size, dtype=torch.bool).tril()
    return torch.zeros(size, size, dtype=dtype).masked_fill_(~seen, float("-inf"))


def clear_cached_masks() -> None:
    """Forget the cached causal masks. A step traced on fake tensors (`lmforge plan` on the CPU) caches fake ones,
    which the real steps of the same process must not use."""
    _causal_mask.cache_clear()


def pieces(length: int, rows: int = CPU_SPLIT_ROWS, split: tuple[int, int] = CPU_SPLIT_LENGTHS) -> list[Piece]:
    """The kernel calls of a causal segment of `length` tokens: one, or for a length in `split` about
    length / `rows`, each over the keys up to its last query. The arguments are there for the benchmark that chose
    them (`split` may not reach past `CPU_SPLIT_LENGTHS`, which the cached mask covers)."""
    low, high = split
    if not low <= length < high:
        return [Piece(slice(0, length), length, True)]
    n = max(1, round(length / rows))
    bounds = [round(i * length / n) for i in range(n + 1)]
    return [Piece(slice(bounds[i], bounds[i + 1]), bounds[i + 1], i == 0) for i in range(n)]


def equal_length_runs(doc_lens: list[int]) -> list[tuple[int, int]]:
    """(segment length, count) of each run of consecutive equal-length segments, in order."""
    runs: list[tuple[int, int]] = []
    for n in doc_lens:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def _rows(parts: list[Tensor]) -> Tensor:
    """[count, heads, l_i, dim] parts of a run along its segments -> the run's [count * length, heads, dim] rows.

    The kernel writes its results as [count, l, heads, dim] in memory, so one part is a view of them and several
    are one concatenation in that layout."""
    joined = parts[0].transpose(1, 2) if len(parts) == 1 else torch.cat([p.transpose(1, 2) for p in parts], dim=1)
    return joined.flatten(0, 1)


def _row(runs: list[Tensor]) -> Tensor:
    """The runs' rows, in order, as the packed row (a view for a single run)."""
    return runs[0] if len(runs) == 1 else torch.cat(runs, dim=0)


@dataclass(frozen=True)
class Run:
    """Consecutive segments of one length, from token `start`, and the kernel calls each of them takes."""

    start: int
    length: int
    count: int
    pieces: list[Piece]

    def views(self, x: Tensor) -> Tensor:
        """The run's segments of a [T, heads, dim] row as [count, heads, length, dim] (a view)."""
        rows = x[self.start : self.start + self.length * self.count]
        return rows.unflatten(0, (self.count, self.length)).transpose(1, 2)


def plan(doc_lens: list[int]) -> list[Run]:
    """The runs of a row with these segment lengths, and their kernel calls (`pieces`)."""
    runs, start = [], 0
    for length, count in equal_length_runs(doc_lens):
        runs.append(Run(start, length, count, pieces(length)))
        start += length * count
    return runs


class CpuSegmentAttention(torch.autograd.Function):
    """Causal attention within each segment of a packed row: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, doc_lens: list[int]) -> Tensor:
        runs = plan(doc_lens)
        outs: list[Tensor] = []
        lses: list[Tensor] = []
        for run in runs:
            qs, ks, vs = (run.views(x) for x in (q, k, v))
            parts = []
            for piece in run.pieces:
                o, lse = _flash(
                    qs[:, :, piece.rows], ks[:, :, : piece.keys], vs[:, :, : piece.keys], 0.0, piece.causal,
                    attn_mask=piece.mask(q.dtype),
                )  # fmt: skip
                parts.append(o)
                lses.append(lse)
            outs.append(_rows(parts))
        out = _row(outs)
        ctx.runs = runs
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, *lses = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        grads: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        calls = iter(lses)
        for run in ctx.runs:
            qs, ks, vs, os, gs = (run.views(x) for x in (q, k, v, out, grad_out))
            dqs, dks, dvs = [], [], []
            for piece in run.pieces:
                dq, dk, dv = _flash_backward(
                    gs[:, :, piece.rows], qs[:, :, piece.rows], ks[:, :, : piece.keys], vs[:, :, : piece.keys],
                    os[:, :, piece.rows], next(calls), 0.0, piece.causal, attn_mask=piece.mask(q.dtype),
                )  # fmt: skip
                dqs.append(dq)
                dks.append(dk)
                dvs.append(dv)
            # The last piece sees every key of the segment; the others' key and value gradients add into its own.
            dk, dv = dks[-1], dvs[-1]
            for piece, piece_dk, piece_dv in zip(run.pieces[:-1], dks[:-1], dvs[:-1], strict=True):
                dk[:, :, : piece.keys] += piece_dk
                dv[:, :, : piece.keys] += piece_dv
            grads[0].append(_rows(dqs))
            grads[1].append(_rows([dk]))
            grads[2].append(_rows([dv]))
        return _row(grads[0]), _row(grads[1]), _row(grads[2]), None


def cpu_segment_attention(q: Tensor, k: Tensor, v: Tensor, doc_lens: list[int]) -> Tensor:
    """Causal attention within each segment (`doc_lens`, summing to T) of q [T, Hq, D], k and v [T, Hkv, D]."""
    return CpuSegmentAttention.apply(q, k, v, doc_lens)  # type: ignore[no-any-return]
