"""`lmforge val-sets`: lm-evaluation-harness-style JSON lines -> an eval set file `OUTPUT/NAME.KIND.jsonl`.

- `--kind ctxcont`: rows `{"context" | "query" | "ctx": str, "choices": [str, ...], "gold": int}` become
  `{"context", "continuations", "label"}`; the first of the three context fields a row has is used.
- `--kind pairs`: rows `{"sentence_good": str, "sentence_bad": str}` (BLiMP) become `{"good", "bad"}`.

Continuations are appended to the context exactly as stored (see `lmforge.eval.sets`); lm-evaluation-harness puts
its `target_delimiter` (a space by default) between them, which `--delimiter " "` reproduces. Rows are checked
as they are converted; an error names the file and line and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from lmforge.data.records import Record, RecordError, read_records
from lmforge.prep.command import parse_args, usage_error

PROG = "lmforge val-sets"
CONTEXT_KEYS = ("context", "query", "ctx")
"""Fields that may hold a `ctxcont` row's context, in order of preference."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


class ConvertError(ValueError):
    """An input row that cannot be converted; the message names the file and line."""


def _string(record: Record, key: str) -> str:
    value = record.data.get(key)
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ConvertError(f"{record.where()}: field {key!r} must be a string, got {got}")
    return value


def ctxcont_row(record: Record, delimiter: str = "") -> dict[str, Any]:
    """One lm-evaluation-harness multiple-choice row as a `ctxcont` row, `delimiter` put before every choice."""
    key = next((k for k in CONTEXT_KEYS if k in record.data), None)
    if key is None:
        raise ConvertError(f"{record.where()}: needs a context field, one of {', '.join(CONTEXT_KEYS)}")
    context = _string(record, key)
    choices, gold = record.data.get("choices"), record.data.get("gold")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ConvertError(f"{record.where()}: 'choices' must be a list of at least 2 non-empty strings")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ConvertError(f"{record.where()}: 'gold' {gold!r} is not a choice index in [0, {len(choices)})")
    return {"context": context, "continuations": [delimiter + c for c in choices], "label": gold}


def pairs_row(record: Record) -> dict[str, Any]:
    """One BLiMP-style row as a `pairs` row."""
    good, bad = _string(record, "sentence_good"), _string(record, "sentence_bad")
    if not good or not bad:
        raise ConvertError(f"{record.where()}: 'sentence_good' and 'sentence_bad' must not be empty")
    return {"good": good, "bad": bad}


def convert(path: Path, kind: str, delimiter: str = "") -> list[dict[str, Any]]:
    """Every row of an input file converted to `kind` rows."""
    try:
        records = list(read_records([path]))
    except RecordError as e:
        raise ConvertError(str(e)) from None
    if not records:
        raise ConvertError(f"{path}: no rows")
    if kind == "ctxcont":
        return [ctxcont_row(r, delimiter) for r in records]
    return [pairs_row(r) for r in records]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Turn lm-evaluation-harness-style JSON lines into an eval set file OUTPUT/NAME.KIND.jsonl "
        "for val.data_dir: multiple choice ({context|query|ctx, choices, gold}) or minimal pairs "
        "({sentence_good, sentence_bad}).",
    )
    parser.add_argument("input", type=Path, help="the input .jsonl (or .parquet) file")
    parser.add_argument("--kind", choices=("ctxcont", "pairs"), required=True, help="the kind of set to write")
    parser.add_argument("--output", type=Path, required=True, help="folder for NAME.KIND.jsonl (created)")
    parser.add_argument("--name", help="the set's name in metric keys (default: the input file's stem)")
    parser.add_argument(
        "--delimiter", default="", help="text put before every choice, e.g. ' ' as lm-evaluation-harness does"
    )
    return parser


def val_sets_main(argv: list[str]) -> int:
    """Run `lmforge val-sets` with the arguments after `val-sets`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    name = args.name if args.name is not None else args.input.name.removesuffix(args.input.suffix)
    if not _NAME.fullmatch(name):
        return usage_error(PROG, f"set name {name!r}: use letters, digits, '_', '-' and '.' (pass --name)")
    if args.output.exists() and not args.output.is_dir():
        return usage_error(PROG, f"--output {args.output}: exists and is not a folder")
    try:
        rows = convert(args.input, args.kind, args.delimiter)
    except ConvertError as e:
        return usage_error(PROG, str(e))
    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output / f"{name}.{args.kind}.jsonl"
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, out)
    print(f"val-sets: {len(rows)} {args.kind} items -> {out}")
    return 0
