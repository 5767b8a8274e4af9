"""`lmforge eval RUN_DIR`: score a training run's model-only snapshots on its `[val]` sets, beside the training."""

from __future__ import annotations

from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args


def _parser() -> CommandParser:
    parser = CommandParser(
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
    return parser


def main(argv: list[str]) -> int:
    """Run the eval worker; returns the exit code (2 for a run that cannot be scored)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
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
