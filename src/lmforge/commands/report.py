"""`lmforge report RUN_DIR -o report.html [--smoothing 0.9]`: one self-contained HTML page about a run.

The page is made by `lmforge.viz.report.write_report`; this module maps flags onto it and prints what it wrote.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.viz.report import DEFAULT_SMOOTHING, write_report
from lmforge.viz.runs import RunError

USAGE = "lmforge report RUN_DIR -o report.html [--smoothing 0.9]"


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge report",
        usage=USAGE,
        description="Write one self-contained HTML page about a run: its curves, a summary and its config.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir")
    parser.add_argument("-o", "--output", type=Path, required=True, help="HTML file to write")
    parser.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        help=f"EMA weight in [0, 1) of the smoothed loss line (default {DEFAULT_SMOOTHING})",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge report` with the arguments after `report`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    # Checked before the run is read, so a bad flag is reported even for a run directory that is also wrong.
    if not 0.0 <= args.smoothing < 1.0:
        return fail("report", f"--smoothing must be in [0, 1), got {args.smoothing}")
    try:
        write_report(args.run_dir, args.output, args.smoothing)
    except RunError as e:
        return fail("report", str(e))
    except OSError as e:  # an --output that is a folder, or lies under a file; the message names the path
        return fail("report", f"{e.filename or args.output}: {e.strerror or e}")
    print(f"wrote {args.output}")
    return 0
