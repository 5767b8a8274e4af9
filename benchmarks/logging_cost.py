"""What watching a run costs: steps/s of lmforge's full loop with every monitor on, against no monitor at all.

The model, data and optimizer are those of the loop-overhead benchmark (`benchmarks/overhead.py`: a d256 x 6 Llama,
seq_len 512, 4096 tokens per step in 4 micro-batches, AdamW, fp32, 2 threads). Both sides run `Trainer.train()`,
the real step loop, for the same steps:

- `off`: no monitor (no console, no metrics.jsonl, no W&B); the step-0 record and log lines have nowhere to go.
- `on`: the rich console (progress bar and a line per step, written to /dev/null), `metrics.jsonl`, and W&B in
  offline mode (when `wandb` is installed), with `log.interval = 1`: the most logging a run can do.

Step times come from a step callback (the same on both sides); the first `--warmup` steps are left out and the
median of the rest counts. Each side runs in its own process, `--repeats` times in alternating order; the best
median of each side is compared. Target: monitors on is at most 2% slower. Before each run the script waits for
idle CPUs (`--quiet-wait`) and it reports the cores other processes used.

    .venv/bin/python benchmarks/logging_cost.py [--steps N] [--warmup N] [--repeats N] [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/logging_cost.py --smoke      # tiny model, few steps
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import common
from cpu_load import ForeignLoad, settle
from lmforge.checkpoint.run_dir import prepare_output_dir
from lmforge.config import TrainConfig
from lmforge.parallel.process_group import init_distributed, shutdown_distributed
from lmforge.train.callbacks.base import Callback
from lmforge.train.trainer import Trainer
from overhead import Settings as OverheadSettings

TARGET = 1.02
"""Step time with every monitor on may be at most this multiple of the step time with none."""
SIDES = ("off", "on")


@dataclass(frozen=True)
class Settings(OverheadSettings):
    """The loop-overhead benchmark's model, data and optimizer, with this benchmark's step counts: `warmup` steps
    left out at the start of each run, then `steps` timed ones, `repeats` runs per side."""

    warmup: int = 3
    steps: int = 30
    repeats: int = 3


SMOKE = common.tiny(Settings, intermediate_size=128, seq_len=64, vocab_size=128, steps=4)
"""A tiny model and batch, and a few steps: checks the script runs, in seconds."""


class StepClock(Callback):
    """Notes the wall time after every optimizer step: the same callback on both sides, so it costs both the same."""

    def __init__(self) -> None:
        """An empty list of times."""
        self.times: list[float] = []

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Note the time at the end of step `trainer.step`."""
        self.times.append(time.perf_counter())


def run_side(side: str, settings: Settings) -> dict[str, Any]:
    """Train with every monitor (`on`) or none (`off`) in this (spawned) process; the timed step durations."""
    torch.set_num_threads(settings.threads)
    os.environ.setdefault("WANDB_SILENT", "true")
    ctx = init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix=f"lmforge-logging-{side}-") as tmp:
            raw = settings.run_config(str(Path(tmp) / "run")).model_dump(by_alias=True)
            # A step's duration is the time between two clock ticks: one step more than the durations kept.
            raw["max_steps"] += 1
            raw["ckpt"] = {"final": False}
            raw["log"] = {"interval": 1}
            has_wandb = importlib.util.find_spec("wandb") is not None
            if side == "on" and has_wandb:
                raw["wandb"] = {"project": "lmforge-logging-cost", "mode": "offline", "dir": str(Path(tmp) / "wandb")}
            config = TrainConfig.model_validate(raw)
            prepare_output_dir(config, overwrite=False)
            clock = StepClock()
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                trainer = Trainer(config, ctx, callbacks=[clock], console=side == "on")
                if side == "off":
                    trainer.monitors.monitors.clear()
                load, t0 = ForeignLoad(), time.perf_counter()
                trainer.train()
                wall = time.perf_counter() - t0
            foreign = load.cores(wall)
            steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)][settings.warmup :]
            monitors = [type(m).__name__ for m in trainer.monitors.monitors]
            return {"side": side, "steps": steps, "foreign_cores": foreign, "monitors": monitors}
    finally:
        shutdown_distributed()


def measure(side: str, settings: Settings) -> dict[str, Any]:
    """One run of one side in a fresh process."""
    result = common.run_in_child(run_side, (side, settings), f"logging-{side}")
    common.raise_for_error(result, f"the {side} side")
    result["median_step_s"] = statistics.median(result["steps"])
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    presets = {"default": Settings(), "smoke": SMOKE}
    smoke = "a tiny model and a few steps"
    return common.benchmark_parser(__doc__, presets, smoke, "before each run", skip={"threads"}).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    args = parse_args(argv)
    settings = common.with_flags(SMOKE if args.smoke else Settings(), args)
    quiet = common.quiet_wait_s(args)
    runs: list[dict[str, Any]] = []
    for i in range(settings.repeats):
        for side in common.in_turn(SIDES, i):
            settle(quiet)
            runs.append(measure(side, settings))
    best = {side: min((r for r in runs if r["side"] == side), key=lambda r: r["median_step_s"]) for side in SIDES}
    ratio = best["on"]["median_step_s"] / best["off"]["median_step_s"]
    title = (
        f"lmforge logging cost: d{settings.hidden_size} x{settings.num_hidden_layers}, {settings.batch_tokens} "
        f"tokens/step, best of {settings.repeats} (median of {settings.steps} steps each)"
    )
    table = common.result_table(title, ("monitors", "median step s", "steps/s", "foreign cores"))
    for side in SIDES:
        b = best[side]
        names = ", ".join(b["monitors"]) or "none"
        table.add_row(names, f"{b['median_step_s']:.4f}", f"{1 / b['median_step_s']:.2f}", f"{b['foreign_cores']:.2f}")
    console = common.make_console()
    console.print(table)
    console.print(f"monitors on / off step time: {ratio:.4f} (target <= {TARGET}): {common.verdict(ratio <= TARGET)}")
    common.write_json(args.json, {"settings": asdict(settings), "runs": runs, "ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
