"""What watching a run costs: steps/s of lmforge's full loop with every monitor on, against no monitor at all.

The model, data and optimizer are those of the loop-overhead benchmark (`benchmarks/overhead.py`: a d256 x 6 Llama,
seq_len 512, 4096 tokens per step in 4 micro-batches, AdamW, fp32, 2 threads). Both sides run `Trainer.train()`,
the real step loop, for the same steps:

- `off`: no monitor (no console, no metrics.jsonl, no W&B); the step-0 record and log lines have nowhere to go.
- `on`: the rich console (progress bar and a line per step, written to /dev/null), `metrics.jsonl`, and W&B in
  offline mode (when `wandb` is installed), with `log.interval = 1`: the most logging a run can do.

Step times come from a step hook (the same on both sides); the first `--warmup` steps are left out and the median
of the rest counts. Each side runs in its own process, `--repeats` times in alternating order; the best median of
each side is compared. Target: monitors on is at most 2% slower. Before each run the script waits for idle CPUs
(`--quiet-wait`) and it reports the cores other processes used.

    .venv/bin/python benchmarks/logging_cost.py [--steps N] [--warmup N] [--repeats N] [--json PATH]
    .venv/bin/python benchmarks/logging_cost.py --smoke      # tiny model, few steps
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from cpu_load import cpu_busy_s, own_cpu_s, wait_until_quiet

_spec = importlib.util.spec_from_file_location("overhead", Path(__file__).with_name("overhead.py"))
assert _spec is not None and _spec.loader is not None
overhead = importlib.util.module_from_spec(_spec)
sys.modules["overhead"] = overhead  # dataclasses look their module up by name
_spec.loader.exec_module(overhead)
Settings = overhead.Settings

TARGET = 1.02
SIDES = ("off", "on")


class _StepClock:
    """Step hook: wall time between consecutive steps."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def after_optimizer_step(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.times.append(time.perf_counter())


def run_side(side: str, settings: Any, warmup: int, conn: Any) -> None:
    """Child process: train with or without monitors, send back the timed step durations."""
    from lmforge.train.parallel import init_distributed, shutdown_distributed
    from lmforge.train.setup import prepare_output_dir
    from lmforge.train.trainer import Trainer

    torch.set_num_threads(settings.threads)
    os.environ.setdefault("WANDB_SILENT", "true")
    ctx = init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix=f"lmforge-logging-{side}-") as tmp:
            raw = settings.train_config(str(Path(tmp) / "run")).model_dump(by_alias=True)
            raw["ckpt"] = {"final": False}
            raw["log"] = {"interval": 1}
            has_wandb = importlib.util.find_spec("wandb") is not None
            if side == "on" and has_wandb:
                raw["wandb"] = {"project": "lmforge-logging-cost", "mode": "offline", "dir": str(Path(tmp) / "wandb")}
            from lmforge.config import TrainConfig

            config = TrainConfig.model_validate(raw)
            prepare_output_dir(config, overwrite=False)
            clock = _StepClock()
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                trainer = Trainer(config, ctx, hooks=[clock], console=side == "on")
                if side == "off":
                    trainer.monitors.monitors.clear()
                busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.perf_counter()
                trainer.train()
                wall = time.perf_counter() - t0
            foreign = max((cpu_busy_s() - busy0 - (own_cpu_s() - own0)) / wall, 0.0)
            steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)][warmup:]
            monitors = [type(m).__name__ for m in trainer.monitors.monitors]
            conn.send({"side": side, "steps": steps, "foreign_cores": foreign, "monitors": monitors})
    finally:
        shutdown_distributed()


def measure(side: str, settings: Any, warmup: int) -> dict[str, Any]:
    """One run of one side in a fresh process."""
    parent, child = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=run_side, args=(side, settings, warmup, child))
    proc.start()
    result = parent.recv()
    proc.join(timeout=60)
    result["median_step_s"] = statistics.median(result["steps"])
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps left out at the start of each run")
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait at most for idle CPUs")
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    settings = Settings()
    steps, warmup, repeats, quiet = args.steps, args.warmup, args.repeats, args.quiet_wait
    if args.smoke:
        settings = replace(settings, hidden_size=64, intermediate_size=128, num_hidden_layers=2, seq_len=64,
                           batch_tokens=256, micro_batch_tokens=128, vocab_size=128, mean_doc_len=32.0)  # fmt: skip
        steps, warmup, repeats, quiet = 4, 1, 1, 0.0
    settings = replace(settings, warmup=0, steps=steps + warmup + 1)
    runs: list[dict[str, Any]] = []
    for i in range(repeats):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            wait_until_quiet(quiet)
            runs.append(measure(side, settings, warmup))
    best = {side: min((r for r in runs if r["side"] == side), key=lambda r: r["median_step_s"]) for side in SIDES}
    ratio = best["on"]["median_step_s"] / best["off"]["median_step_s"]
    title = (
        f"lmforge logging cost: d{settings.hidden_size} x{settings.num_hidden_layers}, {settings.batch_tokens} "
        f"tokens/step, best of {repeats} (median of {steps} steps each)"
    )
    table = Table(title=title)
    for column in ("monitors", "median step s", "steps/s", "foreign cores"):
        table.add_column(column)
    for side in SIDES:
        b = best[side]
        names = ", ".join(b["monitors"]) or "none"
        table.add_row(names, f"{b['median_step_s']:.4f}", f"{1 / b['median_step_s']:.2f}", f"{b['foreign_cores']:.2f}")
    console = Console()
    console.print(table)
    verdict = "PASS" if ratio <= TARGET else "MISS"
    console.print(f"monitors on / off step time: {ratio:.4f} (target <= {TARGET}): {verdict}")
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": asdict(settings), "runs": runs, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
