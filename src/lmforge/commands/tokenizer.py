"""`lmforge tokenizer SUBCOMMAND`: tokenizer tools. One subcommand so far: `lmforge tokenizer train INPUT ...
--output DIR`, a byte-level BPE trained on local text by `lmforge.prep.tokenizer_train.train_tokenizer`."""

from __future__ import annotations

from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.prep.text_sources import SourceError
from lmforge.prep.tokenizer_train import train_tokenizer

SUBCOMMANDS = ("train",)
MAX_VOCAB_SIZE = 2**24
"""The largest --vocab-size: the BPE trainer reserves memory in proportion to it as training starts (283 GB for 2**31),
and a reservation that fails aborts the process instead of raising. Real vocabularies are far below 2**24."""
USAGE = "usage: lmforge tokenizer train INPUT [INPUT ...] --output DIR [options]  (lmforge tokenizer train --help)"


def _train_parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge tokenizer train",
        description="Train a byte-level BPE tokenizer on local text (.txt/.md files, folders, .jsonl, .parquet).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="text files, folders of them, .jsonl or .parquet files")
    parser.add_argument("--output", type=Path, required=True, help="folder to write the tokenizer into")
    parser.add_argument("--vocab-size", type=int, default=8192, help="target vocabulary size (default 8192)")
    parser.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merged pair (default 2)")
    parser.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--model-max-length", type=int, default=2048, help="model_max_length in tokenizer_config")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty output folder")
    return parser


def train_main(argv: list[str]) -> int:
    """Run `lmforge tokenizer train` with the arguments after `train`; returns the exit code (2 for bad input)."""
    args = parse_args(_train_parser(), argv)
    if isinstance(args, int):
        return args
    if args.vocab_size > MAX_VOCAB_SIZE:
        return fail("tokenizer train", f"--vocab-size {args.vocab_size}: must be at most {MAX_VOCAB_SIZE}")
    if args.min_frequency >= 2**64:  # the trainer holds it in 64 bits
        return fail("tokenizer train", f"--min-frequency {args.min_frequency}: must be below 2**64")
    try:
        trained = train_tokenizer(
            args.inputs,
            args.output,
            vocab_size=args.vocab_size,
            min_frequency=args.min_frequency,
            text_key=args.text_key,
            model_max_length=args.model_max_length,
            overwrite=args.overwrite,
        )
    except SourceError as e:
        # Named like the parser's own usage errors, which come from its prog.
        return fail("tokenizer train", str(e))
    print(
        f"tokenizer: vocab {trained.vocab_size} (asked {args.vocab_size}), "
        f"{trained.files} files, {trained.documents} documents -> {trained.output}"
    )
    return 0


def main(argv: list[str]) -> int:
    """Run `lmforge tokenizer` with the arguments after `tokenizer`: the first names the subcommand. Returns the
    exit code (2 for a missing or unknown subcommand, or bad input to it)."""
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    known = ", ".join(SUBCOMMANDS)
    if not argv:
        return fail("tokenizer", f"missing subcommand; known: {known} (lmforge tokenizer train --help)")
    return fail("tokenizer", f"unknown subcommand {argv[0]!r}; known: {known} (lmforge tokenizer train --help)")
