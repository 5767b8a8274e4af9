"""`lmforge val-sets INPUT --kind ctxcont|pairs --output DIR [--name NAME] [--delimiter TEXT]`: an eval set file.

The conversion is `lmforge.prep.val_sets.write_val_set`; this module maps flags onto it and prints one line.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.prep.val_sets import KINDS, ConvertError, write_val_set


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge val-sets",
        description="Turn lm-evaluation-harness-style JSON lines into an eval set file OUTPUT/NAME.KIND.jsonl "
        "for val.data_dir: multiple choice ({context|query|ctx, choices, gold}) or minimal pairs "
        "({sentence_good, sentence_bad}).",
    )
    parser.add_argument("input", type=Path, help="the input .jsonl (or .parquet) file")
    parser.add_argument("--kind", choices=KINDS, required=True, help="the kind of set to write")
    parser.add_argument("--output", type=Path, required=True, help="folder for NAME.KIND.jsonl (created)")
    parser.add_argument("--name", help="the set's name in metric keys (default: the input file's stem)")
    parser.add_argument(
        "--delimiter", default="", help="text put before every choice, e.g. ' ' as lm-evaluation-harness does"
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge val-sets` with the arguments after `val-sets`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        written = write_val_set(args.input, args.kind, args.output, args.name, args.delimiter)
    except ConvertError as e:
        return fail("val-sets", str(e))
    print(f"val-sets: {written.items} {args.kind} items -> {written.path}")
    return 0
