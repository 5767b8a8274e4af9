"""`lmforge tokenize INPUT ... --tokenizer DIR --output DIR [--holdout F --holdout-output DIR]`: token shards.

The work is `lmforge.prep.tokenize.tokenize_corpus`; this module turns flags into its arguments, prints a summary
line per output folder, and reports bad input as one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.data.tokenizer import TokenizerError
from lmforge.prep.text_sources import SourceError
from lmforge.prep.tokenize import tokenize_corpus


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge tokenize",
        description="Tokenize local text into datatrove token shards (.ds, .ds.index, .ds.metadata).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="text files, folders of them, .jsonl or .parquet files")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder or tokenizer.json")
    parser.add_argument("--output", type=Path, required=True, help="folder for the token shards")
    parser.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--tasks", type=int, default=1, help="datatrove tasks, each writes its own files")
    parser.add_argument("--workers", type=int, default=None, help="tasks run at once (default min(tasks, CPUs))")
    parser.add_argument("--max-tokens-per-file", type=int, default=None, help="split a task's output into files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document shuffle and the holdout draw")
    parser.add_argument("--holdout", type=float, default=None, help="fraction of documents to hold out, in (0, 1)")
    parser.add_argument("--holdout-output", type=Path, default=None, help="folder for the holdout shards")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards in existing output folders")
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge tokenize` with the arguments after `tokenize`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        results = tokenize_corpus(
            args.inputs,
            args.tokenizer,
            args.output,
            text_key=args.text_key,
            tasks=args.tasks,
            workers=args.workers,
            max_tokens_per_file=args.max_tokens_per_file,
            seed=args.seed,
            holdout=args.holdout,
            holdout_output=args.holdout_output,
            overwrite=args.overwrite,
        )
    except (SourceError, TokenizerError) as e:
        return fail("tokenize", str(e))
    for job, s in results:
        print(f"{job.label}: {s.documents} documents, {s.tokens} tokens, {s.files} files -> {job.output}")
        if s.documents == 0:
            print(f"warning: {job.label} got no documents", file=sys.stderr)
    return 0
