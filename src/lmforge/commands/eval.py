"""`lmforge eval RUN_DIR`: score a training run's model-only snapshots on its `[val]` sets, beside the training.
`lmforge eval --model FOLDER --config CONFIG`: score one model folder on a training config's `[val]` sets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge eval",
        description="Score a run's model-only snapshots (written with [eval_snapshots]) on its [val] sets, log the "
        "metrics into the run's metrics.jsonl at each snapshot's step, and delete the scored snapshots. Stops after "
        "the snapshot of the run's last step. With --model FOLDER --config CONFIG instead: score that model folder "
        "once on the config's [val] sets and print the metrics.",
    )
    parser.add_argument(
        "run", type=Path, nargs="?", help="the run directory (its config.toml names the model and the sets)"
    )
    parser.add_argument("--poll-seconds", type=float, default=10.0, help="wait between looks for a new snapshot")
    parser.add_argument(
        "--latest-only", action="store_true", help="when several snapshots wait, score the newest, delete the rest"
    )
    parser.add_argument("--limit", type=int, default=None, help="stop after scoring this many snapshots")
    parser.add_argument(
        "--model", type=Path, default=None,
        help="instead of a run: score this model folder (an HF export) once, on the [val] sets of --config",
    )  # fmt: skip
    parser.add_argument("--config", type=Path, default=None, help="with --model: the training config (TOML)")
    parser.add_argument("--json", type=Path, default=None, help="with --model: also write the metrics to this file")
    return parser


def _score_model(args: argparse.Namespace) -> int:
    """`--model FOLDER --config CONFIG`: one validation round, printed (and written to `--json`)."""
    from lmforge.config.loader import ConfigError
    from lmforge.config.resolve import load_train_config
    from lmforge.eval.worker import score_model
    from lmforge.launch.torchrun import env_world_size

    if args.run is not None or args.config is None:
        return fail("eval", "--model takes --config CONFIG and no run directory")
    if not (args.model / "config.json").is_file():
        return fail("eval", f"--model {args.model}: not a model folder (no config.json)")
    try:
        config, _ = load_train_config(["@", str(args.config), "--model.name", str(args.model)], env_world_size())
    except ConfigError as e:
        return fail("eval", str(e))
    if not (config.val.sets or config.val.data):
        return fail("eval", f"--config {args.config} has no [val] sets to score")
    metrics = score_model(config)
    for key, value in metrics.items():
        print(f"{key} {value:.6f}")
    if args.json is not None:
        args.json.write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str]) -> int:
    """Run the eval worker; returns the exit code (2 for a run that cannot be scored)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.model is not None:
        return _score_model(args)
    if args.run is None:
        return fail("eval", "give a run directory, or --model FOLDER --config CONFIG")
    from lmforge.config.loader import ConfigError
    from lmforge.eval.worker import read_run_config, run_worker

    try:
        config = read_run_config(args.run)
    except ConfigError as e:
        return fail("eval", str(e))
    if not (config.val.sets or config.val.data):
        return fail("eval", f"{args.run}/config.toml has no [val] sets to score")
    from lmforge.monitor.base import RecordError

    try:
        run_worker(args.run, config, args.poll_seconds, args.latest_only, args.limit)
    except RecordError as e:  # the run's metrics.jsonl could not be written: stop instead of scoring unrecorded
        return fail("eval", str(e))
    return 0
