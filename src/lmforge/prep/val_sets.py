"""lm-evaluation-harness-style JSON lines -> an eval set file `OUTPUT/NAME.KIND.jsonl` (`lmforge val-sets`).

- `--kind ctxcont`: rows `{"context" | "query" | "ctx": str, "choices": [str, ...], "gold": int}` become
  `{"context", "continuations", "label"}`; the first of the three context fields a row has is used.
- `--kind pairs`: rows `{"sentence_good": str, "sentence_bad": str}` (BLiMP) become `{"good", "bad"}`.

`--delimiter " "` is lm-evaluation-harness's `target_delimiter` (a space by default): it is written as each row's
`target_delimiter`, put between the context and every continuation when scoring. Rows are checked as they are
converted; an error names the file and line and nothing is written. Harness task files (YAML) are converted by
`lmforge.prep.lmeval_task`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.data.records import Record, RecordError, read_records

KINDS = ("ctxcont", "pairs")
"""The kinds of eval set this module writes."""
CONTEXT_KEYS = ("context", "query", "ctx")
"""Fields that may hold a `ctxcont` row's context, in order of preference."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


class ConvertError(ValueError):
    """Input that cannot become an eval set file: a row (the message names the file and line), a set name or an
    output folder."""


def _string(record: Record, key: str) -> str:
    value = record.data.get(key)
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ConvertError(f"{record.where()}: field {key!r} must be a string, got {got}")
    return value


def ctxcont_row(record: Record, delimiter: str = "") -> dict[str, Any]:
    """One lm-evaluation-harness multiple-choice row as a `ctxcont` row, with `delimiter` as its target delimiter."""
    key = next((k for k in CONTEXT_KEYS if k in record.data), None)
    if key is None:
        raise ConvertError(f"{record.where()}: needs a context field, one of {', '.join(CONTEXT_KEYS)}")
    context = _string(record, key)
    choices, gold = record.data.get("choices"), record.data.get("gold")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ConvertError(f"{record.where()}: 'choices' must be a list of at least 2 non-empty strings")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ConvertError(f"{record.where()}: 'gold' {gold!r} is not a choice index in [0, {len(choices)})")
    row: dict[str, Any] = {"context": context, "continuations": choices, "label": gold}
    return {**row, "target_delimiter": delimiter} if delimiter else row


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


@dataclass(frozen=True)
class ValSetFile:
    """An eval set file written by `write_val_set`."""

    path: Path
    """`OUTPUT/NAME.KIND.jsonl`."""
    items: int
    """Rows written, one per input row."""
    kind: str
    """The kind of set written (`ppl`, `ctxcont` or `pairs`)."""


def check_set_name(name: str) -> str:
    """`name` itself when metric keys and file names can carry it, else ConvertError."""
    if not _NAME.fullmatch(name):
        raise ConvertError(f"set name {name!r}: use letters, digits, '_', '-' and '.' (pass --name)")
    return name


def write_rows(rows: list[dict[str, Any]], kind: str, output: Path, name: str) -> ValSetFile:
    """Write converted rows to `output/NAME.KIND.jsonl`, replacing the file in one move so that a reader never
    sees half of it."""
    if output.exists() and not output.is_dir():
        raise ConvertError(f"--output {output}: exists and is not a folder")
    output.mkdir(parents=True, exist_ok=True)
    out = output / f"{name}.{kind}.jsonl"
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, out)
    return ValSetFile(out, len(rows), kind)


def write_val_set(
    input_path: Path, kind: str, output: Path, name: str | None = None, delimiter: str = ""
) -> ValSetFile:
    """Convert `input_path` to `kind` rows (see `convert`) and write them to `output/NAME.KIND.jsonl`.

    `name` defaults to the input file's stem; it must be a set name that metric keys can carry. The whole file is
    converted before anything is written. Raises `ConvertError` for a bad name, kind, output folder or input row.
    """
    if kind not in KINDS:
        raise ConvertError(f"kind {kind!r}: must be one of {', '.join(KINDS)}")
    name = check_set_name(name if name is not None else input_path.name.removesuffix(input_path.suffix))
    if output.exists() and not output.is_dir():
        raise ConvertError(f"--output {output}: exists and is not a folder")
    return write_rows(convert(input_path, kind, delimiter), kind, output, name)
