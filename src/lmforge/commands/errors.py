"""How every command reports bad input: one line on stderr, `lmforge COMMAND: error: ...`, and exit code 2.

Commands parse their arguments with `CommandParser`, which raises instead of printing argparse's usage block and
exiting, so a bad flag and a bad file read the same way. Under torchrun every rank sees the same bad input; only
rank 0 prints it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

BAD_INPUT = 2
"""The exit code of a command refused for bad input (a config, a flag, a file)."""


class UsageError(Exception):
    """A command line that `CommandParser` rejects; the message says which argument and why."""


class CommandParser(argparse.ArgumentParser):
    """An argument parser that raises `UsageError` where argparse would print its usage and exit."""

    def error(self, message: str) -> NoReturn:
        """Raise `UsageError(message)`."""
        raise UsageError(message)


def fail(command: str, message: str) -> int:
    """Print `lmforge <command>: error: <message>` on stderr (rank 0 only) and return `BAD_INPUT`."""
    if os.environ.get("RANK", "0") == "0":
        # Messages name TOML sections such as [model.arch]: escape them so rich does not read them as markup.
        Console(stderr=True).print(
            f"[bold red]lmforge {command}: error:[/] {escape(message)}", highlight=False, soft_wrap=True
        )
    return BAD_INPUT


def parse_args(parser: CommandParser, argv: Sequence[str]) -> argparse.Namespace | int:
    """The parsed arguments, or an exit code: 0 after `--help` (argparse printed it), `BAD_INPUT` after a usage
    error (reported through `fail`, named by the parser's `prog`)."""
    try:
        return parser.parse_args(list(argv))
    except UsageError as e:
        command = parser.prog.removeprefix("lmforge").strip() or "lmforge"
        return fail(command, str(e))
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
