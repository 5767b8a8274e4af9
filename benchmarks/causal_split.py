"""lmforge's causal attention on the CPU against the call a hand-written loop makes: where splitting pays.

For each segment length L the script times forward + backward of causal attention over a packed row of 4096
tokens (4096 // L segments of L, as [tokens, heads, dim] tensors, the model's layout) two ways, alternating, in one
process:

- `plain`: one `F.scaled_dot_product_attention(..., is_causal=True)` over the [segments, heads, L, dim] view of the
  row, what a hand-written loop (and torchtitan's SDPA attention) calls, with autograd's backward;
- `lmforge`: `lmforge.model.cpu_attention.cpu_segment_attention`, what `sdpa_loop` and `auto` run on the CPU: the
  same kernel, with the lengths in `CPU_SPLIT_LENGTHS` split into calls of about `CPU_SPLIT_ROWS` queries, each
  over the keys up to its last query, so that most of the masked half of the score square is never computed, and
  a backward that writes the row's gradients directly.

It prints their ratio per length; `CPU_SPLIT_LENGTHS` is meant to hold the lengths where splitting makes the ratio
drop. `--rows 32,48,...` adds one side per number N: lmforge with N queries per call instead of `CPU_SPLIT_ROWS`,
at every length below 768 (the longest the cached mask covers), which is how that number was chosen.

    .venv/bin/python benchmarks/causal_split.py [--lengths 128,160,192,256,384,512,640,767,768,1024]
                                                [--tokens 4096] [--heads 8] [--kv-heads 4] [--head-dim 32]
                                                [--threads 2] [--repeats 15] [--rows 32,48,96,128] [--json PATH]
    .venv/bin/python benchmarks/causal_split.py --smoke

The median of the repeats counts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import common
import lmforge.model.cpu_attention as cpu_attention
from cpu_load import settle
from lmforge.model.cpu_attention import CPU_SPLIT_LENGTHS, cpu_segment_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def plain_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """The single fused causal call over the row's [segments, heads, L, dim] view."""
    qs, ks, vs = (x.unflatten(0, (-1, length)).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).flatten(0, 1)


def lmforge_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """lmforge's CPU attention over the row's segments."""
    return cpu_segment_attention(q, k, v, [length] * (q.shape[0] // length))


def rows_side(rows: int) -> Attention:
    """lmforge with `rows` queries per kernel call at every length it can split."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
        chosen = cpu_attention.pieces
        cpu_attention.pieces = functools.partial(chosen, rows=rows, split=(1, CPU_SPLIT_LENGTHS[1]))
        try:
            return lmforge_causal(q, k, v, length)
        finally:
            cpu_attention.pieces = chosen

    return attend


def time_pair(
    sides: dict[str, Attention], length: int, tokens: int, heads: int, kv_heads: int, head_dim: int, repeats: int
) -> dict[str, float]:
    """Median milliseconds of forward + backward of each side on the same [T, H, D] row, in alternating order."""
    total = max(1, tokens // length) * length
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(total, heads, head_dim, generator=gen).requires_grad_()
    k, v = (torch.randn(total, kv_heads, head_dim, generator=gen).requires_grad_() for _ in range(2))
    grad = torch.randn(total, heads, head_dim, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(repeats + 1):
        # Each round reverses the order: the side that runs second finds the tensors in cache.
        for name, fn in list(sides.items())[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            fn(q, k, v, length).backward(grad)
            if i >= 1:  # the first round pays for kernel and allocator set-up
                times[name].append((time.perf_counter() - t0) * 1000)
    return {name: statistics.median(ts) for name, ts in times.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,160,192,256,384,512,640,767,768,1024", help="segment lengths L")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per call (segments = tokens // L)")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=32, help="head dimension")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per side and length (median)")
    parser.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait for idle CPUs first")
    parser.add_argument("--rows", default="", help="also time lmforge with these queries per call (comma-separated)")
    parser.add_argument("--smoke", action="store_true", help="two short lengths, 2 repeats")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Time both sides over the lengths and print the table."""
    args = parse_args(argv)
    if args.smoke:
        args.lengths, args.tokens, args.repeats, args.quiet_wait = f"{CPU_SPLIT_LENGTHS[0] - 1},512", 1024, 2, 0.0
    torch.set_num_threads(args.threads)
    settle(args.quiet_wait)
    sides: dict[str, Attention] = {"plain": plain_causal, "lmforge": lmforge_causal}
    extra = [int(n) for n in args.rows.split(",") if n]
    sides |= {f"rows={n}": rows_side(n) for n in extra}
    rows: list[dict[str, Any]] = []
    for length in (int(n) for n in args.lengths.split(",")):
        ms = time_pair(sides, length, args.tokens, args.heads, args.kv_heads, args.head_dim, args.repeats)
        split = CPU_SPLIT_LENGTHS[0] <= length < CPU_SPLIT_LENGTHS[1]
        row = {"length": length, "plain_ms": ms["plain"], "lmforge_ms": ms["lmforge"], "split": split}
        rows.append(row | {f"rows_{n}_ms": ms[f"rows={n}"] for n in extra})
    table = common.result_table(
        f"CPU causal attention over {args.tokens} tokens, forward + backward, {args.heads} heads / {args.kv_heads} KV "
        f"heads of {args.head_dim}, {args.threads} threads; lmforge splits {CPU_SPLIT_LENGTHS[0]} <= L < "
        f"{CPU_SPLIT_LENGTHS[1]}",
        ["L", "segments", "plain ms", "lmforge ms", "lmforge / plain", "lmforge splits"]
        + [f"rows={n} / plain" for n in extra],
    )
    for r in rows:
        table.add_row(
            str(r["length"]), str(max(1, args.tokens // r["length"])), f"{r['plain_ms']:.1f}",
            f"{r['lmforge_ms']:.1f}", f"{r['lmforge_ms'] / r['plain_ms']:.2f}x", "yes" if r["split"] else "no",
            *(f"{r[f'rows_{n}_ms'] / r['plain_ms']:.2f}x" for n in extra),
        )  # fmt: skip
    common.make_console().print(table)
    common.write_json(args.json, {"settings": vars(args) | {"json": None}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
