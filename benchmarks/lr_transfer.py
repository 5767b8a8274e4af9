"""Learning-rate transfer across width under CompleteP, and Muon against AdamW, on the demo data, on the CPU.

Every run trains a Llama from scratch on the demo's Shakespeare token shards (`data/demo/train`, built by
`lmforge demo --prepare-only` if `--data-dir` lacks them) with lmforge's own `Trainer` in a process group of one,
stepped as `Trainer.train` steps it (`trainer.data.next_step()` then `trainer.train_step(...)`), no checkpoint.
All runs share the init seed, the data order, the batch (seq_len 256 windows, document masking on) and the
warmup-stable-decay schedule (linear warmup over 10% of the steps, linear decay to 0 over the last 20%); they
differ only in width, init scheme, optimizer and learning rate. Models are 4 layers deep with heads of 32 dims and
an intermediate size of 8/3 x width rounded to a multiple of 32. The figure of merit is the held-out loss: the mean
cross-entropy (fp32, over every target token) of a fixed set of windows of `data/demo/heldout` (16,384 tokens by
default, the same windows for every run), taken once the run is over.

1. LR transfer (AdamW). Widths 64, 128 and 256, each under `model.init.scheme = "normal"` (the standard
   parameterization: one lr for every parameter) and `"completep"` with base shape width 64 x 4 layers (per-role
   init, lr, weight decay and eps factors, see docs/model.md). At the base shape CompleteP is the standard
   parameterization (every factor is 1), so the width-64 runs are trained once and reported under both schemes.
   The learning rate runs over a grid of powers of 2 (a grid step is 2x). Where the best lr of a (scheme, width)
   lies at the edge of the lrs tried, the grid is extended on that side, one step at a time (`--max-extend` steps
   at most), so the best lr is bracketed by two worse ones. The spread of the best lr across widths is counted in
   grid steps. Target: under CompleteP the best lr moves by at most one grid step across the 4x width range.
2. Muon vs AdamW at width 128 under the standard parameterization. AdamW's runs are the LR-transfer runs of that
   width (its grid); Muon (`adjust_lr = "match_adamw_rms"`, one lr for its matrices and its AdamW groups) runs a
   grid of 4 lrs, extended at an edge as above. These runs also measure the held-out loss every `--eval-every`
   steps. Each optimizer at its best lr (lowest final held-out loss) is read for the tokens it needed to first
   reach a target held-out loss: AdamW's final held-out loss plus `--target-margin` (0.02 nats), a loss both
   optimizers reach when Muon is at least as good, with linear interpolation between two evaluations. Target: Muon
   needs <= 0.8x AdamW's tokens. Each optimizer is read off its one run of fixed length: the target is met near
   the end of AdamW's run, in its decay, so Muon meets the target ahead of AdamW only if it gets there while its
   own lr has not (fully) decayed: a conservative measure of Muon's advantage.

A run whose training loss is not finite, or exceeds its first step's loss by more than 1 nat, is stopped there and
marked diverged (its held-out loss is taken at that point). Runs are in-process, one at a time, in fp32 with
`--threads` threads; other processes on the CPUs slow the benchmark down but do not change its figures, which are
losses and learning rates (the same settings give the same figures).

    .venv/bin/python benchmarks/lr_transfer.py [--steps N] [--batch-tokens N] [--lrs LO HI] [--muon-lrs LO HI]
                                               [--max-extend N] [--eval-every N] [--target-margin X]
                                               [--data-dir DIR] [--threads N] [--json PATH]
    .venv/bin/python benchmarks/lr_transfer.py --smoke     # widths 32 and 64, 2 lrs, 4 steps (~20 s)

lrs are given as base-2 exponents (`--lrs -9 -6` is 2^-9 .. 2^-6). The full benchmark takes about 20 minutes on
2 idle cores. The script always exits 0 when it ran (it is a benchmark, not a test); PASS/MISS marks each target.

This file is the command line; the work is in `lr_transfer_config.py` (the settings and the lmforge config of a
run), `lr_transfer_sweep.py` (training a run, its held-out loss, the lr grid search) and `lr_transfer_report.py`
(the figures read off the runs and the tables).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

import common
from lmforge.parallel.process_group import init_distributed, shutdown_distributed
from lmforge.prep.demo_data import prepare_demo_data
from lr_transfer_config import SCHEMES, SMOKE, Settings
from lr_transfer_report import muon_summary, print_muon, print_transfer, transfer_summary
from lr_transfer_sweep import Runner


def _exp_range(values: list[int] | None) -> tuple[int, ...] | None:
    """The exponents LO..HI of a `--lrs`-style flag (in either order), or None where the flag was not given."""
    if values is None:
        return None
    lo, hi = sorted(values)
    return tuple(range(lo, hi + 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    presets = {"default": Settings(), "smoke": SMOKE}
    smoke = "widths 32 and 64, 2 lrs, 4 steps: checks the script runs"
    # `warmup` is the schedule's warmup fraction here, not a count of untimed steps: no --warmup flag.
    texts = {"steps": "optimizer steps per run"}
    p = common.benchmark_parser(__doc__, presets, smoke, all_cores=True, skip={"warmup"}, texts=texts)
    p.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=None,
        help="hidden sizes, multiples of 32 (default 64 128 256; smoke 32 64)",
    )
    p.add_argument("--base-width", type=int, default=None, help="CompleteP base width (default 64; smoke 32)")
    p.add_argument(
        "--muon-width", type=int, default=None, help="width of the Muon-vs-AdamW comparison (default 128; smoke 32)"
    )
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 4096; smoke 512)")
    for flag, optimizer, default in (("--lrs", "AdamW", "-9 -6"), ("--muon-lrs", "Muon", "-8 -5")):
        help_text = f"{optimizer} lr grid, base-2 exponents LO..HI (default {default}; smoke -8 -7)"
        p.add_argument(flag, type=int, nargs=2, default=None, metavar=("LO", "HI"), help=help_text)
    p.add_argument(
        "--max-extend",
        type=int,
        default=None,
        help="grid steps that may be added on a side where the best lr is at the edge\n(default 2; smoke 0)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between held-out evaluations of the Muon-vs-AdamW runs (default 5)",
    )
    p.add_argument(
        "--target-margin",
        type=float,
        default=None,
        help="target held-out loss = AdamW's best final loss + this (default 0.02)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("data/demo"),
        help="demo data folder (tokenizer, train, heldout), built there if missing\n(default data/demo)",
    )
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The chosen size's settings with the flags applied."""
    base = common.with_flags(SMOKE if args.smoke else Settings(), args)
    changes: dict[str, Any] = {}
    if args.widths is not None:
        changes["widths"] = tuple(args.widths)
    for name in ("base_width", "muon_width", "batch_tokens", "max_extend", "eval_every", "target_margin"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.lrs is not None:
        changes["lr_exps"] = _exp_range(args.lrs)
    if args.muon_lrs is not None:
        changes["muon_lr_exps"] = _exp_range(args.muon_lrs)
    return replace(base, **changes)


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, train every run, print the tables, optionally write the JSON."""
    args = parse_args(argv)
    settings = settings_from_args(args)
    s = settings
    if s.steps < 1 or s.threads < 1 or s.max_extend < 0 or s.eval_every < 1:
        print("lr_transfer.py: --steps, --threads and --eval-every must be >= 1, --max-extend >= 0", file=sys.stderr)
        return 2
    if any(w % s.head_dim for w in (*s.widths, s.base_width, s.muon_width)):
        print(f"lr_transfer.py: widths must be multiples of the head size {s.head_dim}", file=sys.stderr)
        return 2
    if s.batch_tokens % s.micro_batch_tokens or s.eval_tokens % s.micro_batch_tokens:
        print(f"lr_transfer.py: --batch-tokens must be a multiple of {s.micro_batch_tokens}", file=sys.stderr)
        return 2
    torch.set_num_threads(s.threads)
    console = common.make_console()
    prepare_demo_data(args.data_dir, console)
    t0 = time.perf_counter()
    ctx = init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix="lmforge-lr-transfer-") as tmp:
            runner = Runner(s, args.data_dir, ctx, Path(tmp), lambda line: console.print(line, highlight=False))
            transfer = {
                scheme: {w: runner.search("adamw", scheme, w, s.lr_exps) for w in s.widths} for scheme in SCHEMES
            }
            muon = {
                "adamw": runner.search("adamw", "normal", s.muon_width, s.lr_exps),
                "muon": runner.search("muon", "normal", s.muon_width, s.muon_lr_exps),
            }
    finally:
        shutdown_distributed()
    wall = time.perf_counter() - t0
    summary = {
        "settings": asdict(s),
        "runs": [r.as_dict() for r in sorted(runner.runs.values(), key=lambda r: r.key)],
        "transfer": transfer_summary(transfer),
        "muon": muon_summary(s, muon),
        "wall_s": wall,
    }
    print_transfer(s, transfer, summary["transfer"], console)
    print_muon(s, muon, summary["muon"], console)
    console.print(f"{len(runner.runs)} runs in {wall / 60:.1f} min", highlight=False)
    common.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
