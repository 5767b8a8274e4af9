"""`lmforge val-sets INPUT --kind ctxcont|pairs --output DIR [--name NAME] [--delimiter TEXT]` and
`lmforge val-sets TASK.yaml --output DIR [--data FILE] [--name NAME]`: an eval set file.

The conversions are `lmforge.prep.val_sets.write_val_set` (harness-style rows) and
`lmforge.prep.lmeval_task.write_task_set` (a harness task file); this module maps flags onto them and prints one
line.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.prep.lmeval_task import write_task_set
from lmforge.prep.val_sets import KINDS, ConvertError, write_val_set

TASK_SUFFIXES = (".yaml", ".yml")
"""Input files read as lm-evaluation-harness task files."""


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge val-sets",
        description="Turn lm-evaluation-harness-style JSON lines into an eval set file OUTPUT/NAME.KIND.jsonl "
        "for val.data_dir: multiple choice ({context|query|ctx, choices, gold}) or minimal pairs "
        "({sentence_good, sentence_bad}); or convert a harness task file (TASK.yaml, multiple_choice or "
        "loglikelihood_rolling) with its local data.",
    )
    parser.add_argument("input", type=Path, help="the input .jsonl (or .parquet) file, or a harness task .yaml")
    parser.add_argument("--kind", choices=KINDS, help="the kind of set to write (rows only; a task file gives it)")
    parser.add_argument("--output", type=Path, required=True, help="folder for NAME.KIND.jsonl (created)")
    parser.add_argument("--name", help="the set's name in metric keys (default: the input file's stem, or the task)")
    parser.add_argument(
        "--delimiter", help="rows only: text put before every choice, e.g. ' ' as lm-evaluation-harness does"
    )
    parser.add_argument(
        "--data", type=Path, help="task files only: the local data file (default: the task's dataset_kwargs)"
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge val-sets` with the arguments after `val-sets`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    task = args.input.suffix in TASK_SUFFIXES
    try:
        if task:
            for flag in ("kind", "delimiter"):
                if getattr(args, flag) is not None:
                    raise ConvertError(f"--{flag} is for row files; a task file sets it ({args.input})")
            written = write_task_set(args.input, args.output, args.data, args.name)
        else:
            if args.kind is None:
                raise ConvertError("--kind is required for a row file (ctxcont or pairs)")
            if args.data is not None:
                raise ConvertError("--data is for task files (TASK.yaml); a row file is the data itself")
            written = write_val_set(args.input, args.kind, args.output, args.name, args.delimiter or "")
    except ConvertError as e:
        return fail("val-sets", str(e))
    print(f"val-sets: {written.items} {written.kind} items -> {written.path}")
    return 0
