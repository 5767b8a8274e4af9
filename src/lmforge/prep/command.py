"""What the data-preparation commands share: argument parsing that returns exit codes, and one-line errors."""

from __future__ import annotations

import argparse
import sys


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parsed arguments, or the exit code when argparse has already printed help or a usage error."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)


def usage_error(prog: str, message: str) -> int:
    """Print a one-line error for `prog` on stderr and return exit code 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
