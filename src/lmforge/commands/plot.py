"""`lmforge plot RUN_DIR [RUN_DIR ...] [--metric PATTERN ...] -o curves.png [--smoothing 0.9]`: curves in an image.

The drawing is `lmforge.viz.plot.plot_runs`; this module maps flags onto it and prints what it wrote.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.viz.plot import DEFAULT_METRICS, DEFAULT_SMOOTHING, PlotError, plot_runs
from lmforge.viz.runs import RunError

USAGE = "lmforge plot RUN_DIR [RUN_DIR ...] [--metric PATTERN ...] -o curves.png [--smoothing 0.9]"


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge plot",
        usage=USAGE,
        description="Overlay the training curves of runs (their metrics.jsonl) in one image, one subplot per metric.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_dir")
    parser.add_argument(
        "--metric",
        "-m",
        action="append",
        metavar="PATTERN",
        help="metric name or glob, e.g. 'optim/grad_norm/*' or 'val/*/bpb@*'; repeatable (default: loss/mean)",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="image to write (.png, .svg or .pdf)")
    parser.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        help=f"EMA weight in [0, 1) of the solid lines; 0 draws the raw values only (default {DEFAULT_SMOOTHING})",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge plot` with the arguments after `plot`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        names = plot_runs(args.run_dirs, args.metric or list(DEFAULT_METRICS), args.output, args.smoothing)
    except (RunError, PlotError) as e:
        return fail("plot", str(e))
    except OSError as e:  # an --output that is a folder, or lies under a file; the message names the path
        return fail("plot", f"{e.filename or args.output}: {e.strerror or e}")
    print(f"wrote {args.output}: {len(names)} metric(s) of {len(args.run_dirs)} run(s)")
    return 0
