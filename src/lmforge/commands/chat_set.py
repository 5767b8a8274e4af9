"""`lmforge chat-set --output DIR [--seed N] [--val-fraction F] [--max-examples N]`: a chat SFT set from the plays.

The set is built and written by `lmforge.prep.chat_set.write_chat_set`; this module maps flags onto it and prints
a one-line summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.prep.chat_set import DEFAULT_TRAIN_EXAMPLES, ChatSetError, summary, write_chat_set


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge chat-set",
        description="Write a small chat SFT set (train.jsonl, val.jsonl of {id, messages}) made from Shakespeare's "
        "plays: continue a line, name the play, name the speaker. Val holds whole scenes.",
    )
    parser.add_argument("--output", type=Path, required=True, help="folder for train.jsonl and val.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scene split and of the sampling")
    parser.add_argument(
        "--val-fraction", type=float, default=0.05, help="share of scenes held out for val.jsonl, in [0, 1)"
    )
    parser.add_argument(
        "--max-examples",
        type=int,
        default=DEFAULT_TRAIN_EXAMPLES,
        help=f"train examples to write (default {DEFAULT_TRAIN_EXAMPLES}; fewer if the scenes run out); val gets "
        "as many per spoken line of its scenes",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge chat-set` with the arguments after `chat-set`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    start = time.perf_counter()
    try:
        chat_set = write_chat_set(args.output, args.seed, args.val_fraction, args.max_examples)
    except ChatSetError as e:
        return fail("chat-set", str(e))
    print(f"{summary(chat_set, time.perf_counter() - start)} -> {args.output}")
    if args.val_fraction > 0 and not chat_set.val:
        print(f"warning: no scene was drawn for val at --val-fraction {args.val_fraction}", file=sys.stderr)
    return 0
