"""`lmforge eval RUN_DIR`: score a training run's model-only snapshots on its `[val]` sets, beside the training.

The trainer writes `<run>/snapshots/step_N/` every `eval_snapshots.interval` steps and at the last step (renamed
into place once complete). The worker, on its own processes (plain or under torchrun, on other GPUs), builds the
model and the validation sets once from the run's `config.toml`, then repeatedly takes the oldest complete
snapshot, loads it into the model, runs one validation round, appends the metrics to `<run>/metrics.jsonl` at the
snapshot's step, marks the snapshot scored and deletes it. It stops after the snapshot of the run's last step.
A worker killed and started again continues with the snapshots still there; one killed after logging but before
deleting finds the mark and deletes the snapshot without scoring it again.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from lmforge.config.train import TrainConfig

SCORED = "SCORED"
"""Marker file inside a snapshot whose metrics are logged."""


def pending_snapshots(root: Path) -> list[int]:
    """Steps of the complete snapshots under `root`, oldest first."""
    from lmforge.train.checkpoint import list_checkpoints

    return list_checkpoints(root) if root.is_dir() else []


def eval_main(argv: list[str]) -> int:
    """Run the worker; returns the exit code (2 for a run that cannot be scored)."""
    parser = argparse.ArgumentParser(
        prog="lmforge eval",
        description="Score a run's model-only snapshots (written with [eval_snapshots]) on its [val] sets, log the "
        "metrics into the run's metrics.jsonl at each snapshot's step, and delete the scored snapshots. Stops after "
        "the snapshot of the run's last step.",
    )
    parser.add_argument("run", type=Path, help="the run directory (its config.toml names the model and the sets)")
    parser.add_argument("--poll-seconds", type=float, default=10.0, help="wait between looks for a new snapshot")
    parser.add_argument(
        "--latest-only", action="store_true", help="when several snapshots wait, score the newest, delete the rest"
    )
    parser.add_argument("--limit", type=int, default=None, help="stop after scoring this many snapshots")
    args = parser.parse_args(argv)

    from lmforge.cli import _err
    from lmforge.config.loader import ConfigError

    try:
        config = _run_config(args.run)
    except ConfigError as e:
        _err(str(e))
        return 2
    if not (config.val.sets or config.val.data):
        _err(f"{args.run}/config.toml has no [val] sets to score")
        return 2
    return _work(args, config)


def _run_config(run: Path) -> TrainConfig:
    from lmforge.config import ConfigError
    from lmforge.config.loader import compose, validate
    from lmforge.config.train import TrainConfig

    path = run / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{run} is not a run directory: {path} is missing")
    raw = compose(["@", str(path)])
    config = validate(TrainConfig, raw)
    assert isinstance(config, TrainConfig)
    return config


def _work(args: argparse.Namespace, config: TrainConfig) -> int:
    import torch.distributed as dist

    from lmforge.data import load_tokenizer
    from lmforge.model import build_model
    from lmforge.monitor import JsonlMonitor
    from lmforge.train.checkpoint import SNAPSHOTS, load_model_state, step_name
    from lmforge.train.parallel import init_distributed, parallelize, shutdown_distributed
    from lmforge.train.setup import model_vocab_size
    from lmforge.train.validation import Validator

    run: Path = args.run
    ctx = init_distributed()
    console = Console()
    try:
        tokenizer = load_tokenizer(config.tokenizer.name) if config.tokenizer.name else None
        arch = config.model.arch
        model = build_model(arch, model_vocab_size(config, tokenizer), config.model.attn, ctx.device, meta=True)
        model = parallelize(model, model.blocks, config.model, ctx)
        validator = Validator(config.val, config.data, tokenizer, ctx.rank, ctx.world_size)
        monitor = JsonlMonitor(run / "metrics.jsonl") if ctx.is_main else None
        root, scored = run / SNAPSHOTS, 0
        while args.limit is None or scored < args.limit:
            steps = pending_snapshots(root)
            if ctx.world_size > 1:  # every rank takes the same snapshot
                shared = [steps]
                dist.broadcast_object_list(shared, src=0)
                steps = shared[0]
            if not steps:
                time.sleep(args.poll_seconds)
                continue
            step = steps[-1] if args.latest_only else steps[0]
            folder = root / step_name(step)
            if not (folder / SCORED).exists():
                load_model_state(folder, model)
                arrays = run / "val_arrays" / f"step_{step}" if config.val.save_arrays and ctx.is_main else None
                metrics = validator.evaluate(model, ctx.device, arrays)
                if monitor is not None:
                    monitor.log(step, metrics)
                    (folder / SCORED).touch()
                    console.print(f"eval: step {step} scored ({metrics['time/val']:.1f} s)", highlight=False)
                scored += 1
            if ctx.world_size > 1:
                dist.barrier()  # every rank is done reading before the files go
            if ctx.is_main:
                for s in steps if args.latest_only else [step]:
                    if s <= step:
                        shutil.rmtree(root / step_name(s), ignore_errors=True)
            if step >= config.max_steps:
                break
        if monitor is not None:
            monitor.close()
    finally:
        shutdown_distributed()
    return 0
