"""Raw text inputs: `.txt`/`.md` files (one document each), `.jsonl` and `.parquet` files (one per row), folders.

Both `lmforge tokenizer train` and `lmforge tokenize` read their inputs through this module, so they accept the same
paths and report bad input the same way: a `SourceError` whose message names the file (and the row).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FileKind = Literal["text", "jsonl", "parquet"]

_KINDS: dict[str, FileKind] = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}

# Parquet files are read a batch of rows at a time so a large file never has to fit in memory.
_PARQUET_BATCH_ROWS = 4096


class SourceError(ValueError):
    """Unreadable or malformed input text; the message names the file and, where it applies, the row."""


@dataclass(frozen=True)
class InputFile:
    """One input file and how to read it."""

    path: Path
    """Where the file is."""
    name: str
    """Stable name used in document ids: the file name, or `folder/relative/path` for a file found in a folder."""
    kind: FileKind
    """`text` (one document per file), `jsonl` or `parquet` (one document per row)."""


def _kind(path: Path) -> FileKind | None:
    return _KINDS.get(path.suffix.lower())


def _is_hidden(relative: Path) -> bool:
    # Hidden entries are tool state (.git, .datatrove logs, editor swap files), never corpus text.
    return any(part.startswith(".") for part in relative.parts)


def list_input_files(paths: list[Path]) -> list[InputFile]:
    """Expand input paths into the files to read, in a fixed order.

    A file must end in .txt, .md, .jsonl or .parquet. A folder contributes every such file below it (recursively,
    sorted by relative path, hidden entries skipped) and must hold at least one. Raises `SourceError` otherwise.
    """
    if not paths:
        raise SourceError("no input paths given")
    files: list[InputFile] = []
    for path in paths:
        if path.is_dir():
            root = path.resolve().name or str(path)
            found = []
            for p in path.rglob("*"):
                relative = p.relative_to(path)
                kind = _kind(p)
                if kind is not None and p.is_file() and not _is_hidden(relative):
                    found.append(InputFile(p, f"{root}/{relative.as_posix()}", kind))
            if not found:
                raise SourceError(f"input folder {path}: holds no .txt, .md, .jsonl or .parquet files")
            files.extend(sorted(found, key=lambda f: f.name))
        elif path.is_file():
            kind = _kind(path)
            if kind is None:
                raise SourceError(f"input file {path}: unsupported type (expected .txt, .md, .jsonl or .parquet)")
            files.append(InputFile(path, path.name, kind))
        else:
            raise SourceError(f"input path {path}: does not exist")
    return files


def _read_text_file(file: InputFile) -> str:
    try:
        return file.path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"{file.path}: not valid UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise SourceError(f"{file.path}: cannot be read: {e.strerror}") from None


def _row_text(value: object, file: InputFile, row: int, text_key: str) -> str:
    if not isinstance(value, str):
        shown = "null" if value is None else type(value).__name__
        raise SourceError(f"{file.path}: row {row}: field {text_key!r} must be a string, got {shown}")
    return value


def _iter_jsonl(file: InputFile, text_key: str, shard: tuple[int, int]) -> Iterator[tuple[str, str]]:
    rank, count = shard
    try:
        with file.path.open("r", encoding="utf-8") as handle:
            # Rows are numbered by line (from 1) so an error points straight at the line to fix.
            for row, line in enumerate(handle, start=1):
                # Rows of other shards are skipped before parsing: with N tasks each row is parsed once, not N times.
                if (row - 1) % count != rank or not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"{file.path}: row {row}: invalid JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(record, dict):
                    raise SourceError(f"{file.path}: row {row}: expected a JSON object, got {type(record).__name__}")
                if text_key not in record:
                    raise SourceError(f"{file.path}: row {row}: no field {text_key!r} (fields: {sorted(record)})")
                text = _row_text(record[text_key], file, row, text_key)
                if text:
                    yield f"{file.name}:{row}", text
    except UnicodeDecodeError as e:
        raise SourceError(f"{file.path}: not valid UTF-8 text (byte {e.start})") from None


def _iter_parquet(file: InputFile, text_key: str, shard: tuple[int, int]) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{file.path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    rank, count = shard
    try:
        table = pq.ParquetFile(file.path)
    except Exception as e:
        raise SourceError(f"{file.path}: not a readable parquet file: {e}") from None
    columns = table.schema_arrow.names
    if text_key not in columns:
        raise SourceError(f"{file.path}: no column {text_key!r} (columns: {columns})")
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if (row - 1) % count != rank:
                continue
            text = _row_text(value, file, row, text_key)
            if text:
                yield f"{file.name}:{row}", text


def iter_file_documents(
    file: InputFile, text_key: str = "text", shard: tuple[int, int] = (0, 1)
) -> Iterator[tuple[str, str]]:
    """Yield `(document id, text)` for one file; empty texts are skipped.

    `shard = (rank, count)` keeps only rows whose 0-based index is `rank` modulo `count`, so `count` readers of the
    same file see disjoint rows (a text file is row 0). Rows are numbered from 1 in ids and errors: `name:row`.
    """
    rank, count = shard
    if count < 1 or not 0 <= rank < count:
        raise ValueError(f"shard {shard}: expected (rank, count) with 0 <= rank < count")
    if file.kind == "jsonl":
        yield from _iter_jsonl(file, text_key, shard)
    elif file.kind == "parquet":
        yield from _iter_parquet(file, text_key, shard)
    elif rank == 0:
        text = _read_text_file(file)
        if text:
            yield file.name, text


def iter_documents(paths: list[Path], text_key: str = "text") -> Iterator[tuple[str, str]]:
    """Yield `(document id, text)` for every document under the input paths, in a fixed order."""
    for file in list_input_files(paths):
        yield from iter_file_documents(file, text_key)
