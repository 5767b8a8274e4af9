"""Where `model.attn = "auto"` switches on the CPU: per-segment causal SDPA against SDPA with a block-diagonal mask.

For rows of T tokens cut into S segments, the script times forward + backward of one attention call with each of
the two CPU backends (`sdpa_loop`: the fused causal kernel per run of equal-length segments; `sdpa`: one SDPA over
the row with a [T, T] boolean mask, which PyTorch runs with its math kernel) and prints their ratio. `auto` runs
the loop while its calls x `CPU_MASK_AREA_PER_CALL` <= T x T; the table shows where the loop stops being faster and what
`auto` runs.

The segments alternate between two lengths around T / S (`--layout varied`, the default), so no two neighbours share
a length and the loop makes one kernel call per segment, as with real documents; `--layout equal` cuts the row into
equal segments, which the loop batches into a single call (its best case).

    .venv/bin/python benchmarks/attention_switch.py [--lengths 1024,2048,4096] [--layout varied|equal] [--heads 8]
                                                    [--kv-heads 4] [--head-dim 32] [--threads 2] [--repeats 7]
                                                    [--json PATH]
    .venv/bin/python benchmarks/attention_switch.py --smoke

Both backends run in the same process, alternating per layout, and the median of the repeats counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import common
from cpu_load import settle
from lmforge.model.attention import (
    CPU_MASK_AREA_PER_CALL,
    DocumentMask,
    choose_backend,
    equal_length_runs,
    get_attention,
)


def time_backend(name: str, seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, repeats: int) -> float:
    """Median milliseconds of forward + backward of backend `name` on one row with these segments."""
    total = sum(seq_lens)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, heads, head_dim, generator=gen).requires_grad_()
    k = torch.randn(total, kv_heads, head_dim, generator=gen).requires_grad_()
    v = torch.randn(total, kv_heads, head_dim, generator=gen).requires_grad_()
    fn = get_attention(name)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        # A new mask per call, as every forward builds one: the dense backend pays for its [T, T] mask each time.
        mask = DocumentMask.from_doc_lens(torch.tensor(seq_lens), q.device)
        fn(q, k, v, mask).sum().backward()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def equal_segments(total: int, count: int) -> list[int]:
    """`count` segment lengths that differ by at most one and add up to `total`."""
    base, extra = divmod(total, count)
    return [base + (i < extra) for i in range(count)]


def varied_segments(total: int, count: int) -> list[int]:
    """`count` segment lengths adding up to `total` that alternate between about half and 1.5 times the mean, so
    that neighbours differ (where the mean is at least 2 tokens)."""
    lens = equal_segments(total, count)
    for i in range(0, count - 1, 2):
        shift = lens[i] // 2
        lens[i] -= shift
        lens[i + 1] += shift
    return lens


LAYOUTS = {"varied": varied_segments, "equal": equal_segments}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="row lengths T, comma-separated")
    parser.add_argument("--segments", default="1,2,4,8,12,16,24,32,48,64,128", help="segment counts S")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="varied", help="segment lengths (see above)")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=32, help="head dimension")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per backend and layout (median)")
    parser.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait for idle CPUs first")
    parser.add_argument("--smoke", action="store_true", help="one short length, few layouts, 2 repeats")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Time both backends over the layouts and print the table."""
    args = parse_args(argv)
    if args.smoke:
        args.lengths, args.segments, args.repeats, args.quiet_wait = "256", "1,4,32", 2, 0.0
    torch.set_num_threads(args.threads)
    settle(args.quiet_wait)
    for name in ("sdpa_loop", "sdpa"):  # the first calls of a process pay for kernel and allocator set-up
        time_backend(name, [64, 64], args.heads, args.kv_heads, args.head_dim, 1)
    rows: list[dict[str, Any]] = []
    for total in (int(t) for t in args.lengths.split(",")):
        for count in (int(s) for s in args.segments.split(",")):
            if count > total:
                continue
            lens = LAYOUTS[args.layout](total, count)
            shape = (args.heads, args.kv_heads, args.head_dim, args.repeats)
            loop, dense = (time_backend(name, lens, *shape) for name in ("sdpa_loop", "sdpa"))
            calls = len(equal_length_runs(lens))
            rows.append({"tokens": total, "segments": count, "calls": calls, "loop_ms": loop, "dense_ms": dense})
    console = common.make_console()
    table = common.result_table(
        f"CPU attention, forward + backward, {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, "
        f"{args.threads} threads, {args.layout} segments; auto loops while calls x {CPU_MASK_AREA_PER_CALL} <= T x T",
        ["T", "segments", "mean length", "loop calls", "per-segment ms", "masked ms", "masked / per-segment",
         "auto runs"],
    )  # fmt: skip
    for r in rows:
        lens = LAYOUTS[args.layout](r["tokens"], r["segments"])
        auto = "per-segment" if choose_backend(lens, torch.device("cpu")) == "sdpa_loop" else "masked"
        table.add_row(
            str(r["tokens"]), str(r["segments"]), str(r["tokens"] // r["segments"]), str(r["calls"]),
            f"{r['loop_ms']:.2f}", f"{r['dense_ms']:.2f}", f"{r['dense_ms'] / r['loop_ms']:.2f}x", auto,
        )  # fmt: skip
    console.print(table)
    common.write_json(args.json, {"settings": vars(args) | {"json": None}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
