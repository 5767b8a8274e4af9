"""Per-segment causal attention on the CPU, on PyTorch's CPU flash kernel, with a backward of its own.

`sdpa_loop` on the CPU runs here. A packed row [T, heads, dim] holds segments; consecutive segments of one length
form a run, and each run is one batched causal kernel call ([count, heads, length, dim] views of the row, no copy).
This is faster than calling `F.scaled_dot_product_attention` per run and leaving the rest to autograd because the
backward writes into the row's gradients: through autograd, every run's slice of q, k and v gets a zero-filled
gradient of the whole row, and the outputs' concatenation a split, so a row of S segments costs S full-size zero
fills and additions per tensor. Here the forward keeps the kernel's log-sum-exp per run and joins the runs' outputs
into the row (a view when the row is one run); the backward calls the kernel's backward per run and joins its
gradients the same way.

Segments are not split into smaller causal calls. The kernel scores keys in blocks of 512, so one causal call over
a segment shorter than 768 tokens computes its whole L x L square, and calls of about 64 queries each over the keys
up to their last query compute little more than the causal half: 0.76x the attention time at L = 512 measured
alone. In a whole training step the extra calls' host work cancelled that and more (0.95-0.98x the step's speed
without the split, measured step by step in one process: docs/benchmarks.md), so the split was removed.

The kernel calls are PyTorch's own: `aten::_scaled_dot_product_flash_attention_for_cpu` and its backward, the pair
`F.scaled_dot_product_attention` dispatches to on the CPU. They take grouped-query attention as it is (fewer
key/value heads than query heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lmforge.model.masks import band_bias

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def equal_length_runs(doc_lens: list[int]) -> list[tuple[int, int]]:
    """(segment length, count) of each run of consecutive equal-length segments, in order."""
    runs: list[tuple[int, int]] = []
    for n in doc_lens:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def _rows(part: Tensor) -> Tensor:
    """A run's [count, heads, length, dim] kernel result -> its [count * length, heads, dim] rows (a view: the
    kernel writes its results as [count, length, heads, dim] in memory)."""
    return part.transpose(1, 2).flatten(0, 1)


def _row(runs: list[Tensor]) -> Tensor:
    """The runs' rows, in order, as the packed row (a view for a single run)."""
    return runs[0] if len(runs) == 1 else torch.cat(runs, dim=0)


@dataclass(frozen=True)
class Run:
    """Consecutive segments of one length, from token `start`: one kernel call."""

    start: int
    length: int
    count: int

    def views(self, x: Tensor) -> Tensor:
        """The run's segments of a [T, heads, dim] row as [count, heads, length, dim] (a view)."""
        rows = x[self.start : self.start + self.length * self.count]
        return rows.unflatten(0, (self.count, self.length)).transpose(1, 2)


def plan(doc_lens: list[int]) -> list[Run]:
    """The runs of a row with these segment lengths."""
    runs, start = [], 0
    for length, count in equal_length_runs(doc_lens):
        runs.append(Run(start, length, count))
        start += length * count
    return runs


def _masks(runs: list[Run], window: int | None, q: Tensor) -> list[Tensor | None]:
    """Each run's sliding-window mask, None where the run's segments fit in the window (plain causal)."""
    if window is None:
        return [None] * len(runs)
    return [band_bias(run.length, window, q.dtype, q.device) if run.length > window else None for run in runs]


def _lse_rows(lse: Tensor) -> Tensor:
    """A run's log-sum-exp [count, heads, length] as [count * length, heads] rows."""
    return lse.transpose(1, 2).flatten(0, 1)


class CpuSegmentAttention(torch.autograd.Function):
    """Causal attention within each segment of a packed row: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D];
    with a window, each query attends the `window` keys up to itself (a segment longer than the window gets the
    kernel's additive band mask instead of its causal flag); with sinks [Hq], each head's sink logit joins the
    softmax's denominator (`lmforge.model.sinks`).

    Sinks: the kernel's output o and log-sum-exp L become o' = o * exp(L - L') with L' = log(exp(L) + exp(s)).
    The kernel's backward, given o' and L' in place of its own, is the backward of attention with the sink: it
    recomputes the weights as exp(x - L') and takes rowsum(grad * o') as the softmax's correction term, and the
    sink's value column is zero. The sink's own gradient is -sum over queries of exp(s - L') rowsum(grad * o')."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, doc_lens: list[int], window: int | None, sinks: Tensor | None
    ) -> Tensor:
        runs = plan(doc_lens)
        masks = _masks(runs, window, q)
        outs: list[Tensor] = []
        lses: list[Tensor] = []
        for run, band in zip(runs, masks, strict=True):
            o, lse = _flash(run.views(q), run.views(k), run.views(v), 0.0, band is None, attn_mask=band)[:2]
            o = _rows(o)
            if sinks is not None:
                with_sink = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
                o = o * torch.exp(_lse_rows(lse) - _lse_rows(with_sink)).unsqueeze(-1).to(o.dtype)
                lse = with_sink
            outs.append(o)
            lses.append(lse)
        out = _row(outs)
        ctx.runs, ctx.masks = runs, masks
        ctx.save_for_backward(q, k, v, out, sinks, *lses)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, Tensor | None]:
        q, k, v, out, sinks, *lses = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        grads: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        for run, lse, band in zip(ctx.runs, lses, ctx.masks, strict=True):
            qs, ks, vs, os, gs = (run.views(x) for x in (q, k, v, out, grad_out))
            parts = _flash_backward(gs, qs, ks, vs, os, lse, 0.0, band is None, attn_mask=band)
            for into, grad in zip(grads, parts, strict=True):
                into.append(_rows(grad))
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            lse_rows = _row([_lse_rows(lse) for lse in lses])
            correction = (grad_out.to(lse_rows.dtype) * out.to(lse_rows.dtype)).sum(-1)  # [T, heads]
            grad_sinks = -(torch.exp(sinks.to(lse_rows.dtype) - lse_rows) * correction).sum(0).to(sinks.dtype)
        return _row(grads[0]), _row(grads[1]), _row(grads[2]), None, None, grad_sinks


def cpu_segment_attention(
    q: Tensor, k: Tensor, v: Tensor, doc_lens: list[int], window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """Causal attention within each segment (`doc_lens`, summing to T) of q [T, Hq, D], k and v [T, Hkv, D], each
    query over at most `window` keys ending at itself when a window is given, with one sink logit per query head
    in the softmax's denominator when sinks [Hq] are given."""
    return CpuSegmentAttention.apply(q, k, v, doc_lens, window, sinks)  # type: ignore[no-any-return]
