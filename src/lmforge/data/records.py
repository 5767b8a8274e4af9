"""Rows of supervised fine-tuning datasets read from local files: JSON lines, parquet, or `save_to_disk` folders.

A folder written by HF `datasets` `Dataset.save_to_disk` holds `state.json`, `dataset_info.json` and arrow files in
the arrow *stream* format; `state.json["_data_files"]` lists those files in row order. It is read with pyarrow alone,
so `datasets` is not needed at run time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

_JSONL = (".jsonl", ".json")
_FILE_SUFFIXES = (*_JSONL, ".parquet", ".arrow")
_FOLDER_SUFFIXES = (".jsonl", ".parquet")


class RecordError(ValueError):
    """A dataset file or row that cannot be read; the message names the file (and row)."""


@dataclass(frozen=True)
class Record:
    """One row of a dataset file."""

    source: str
    """The file the row came from."""
    row: int
    """0-based row index within that file (blank JSONL lines are not rows)."""
    data: dict[str, Any]
    """The row's fields as JSON-like python values."""
    line: int | None = None
    """1-based line number for JSONL rows, which differs from `row + 1` once blank lines are skipped."""

    def where(self) -> str:
        """Where the row is, for messages: `FILE line N` for JSONL, `FILE row N` otherwise."""
        return f"{self.source} line {self.line}" if self.line is not None else f"{self.source} row {self.row}"


def _saved_dataset_files(folder: Path) -> list[Path]:
    try:
        entries = json.loads((folder / "state.json").read_text(encoding="utf-8"))["_data_files"]
        files = [folder / entry["filename"] for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordError(f"{folder}: cannot read the data files listed in state.json: {e}") from None
    for file in files:
        if not file.is_file():
            raise RecordError(f"{folder}: state.json lists {file.name}, which is missing")
    return files


def _folder_files(folder: Path) -> list[Path]:
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise RecordError(
            f"{folder} is a DatasetDict with splits {', '.join(map(str, splits))}; point at one split folder, "
            f"e.g. {folder / str(splits[0]) if splits else folder / 'train'}"
        )
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        return _saved_dataset_files(folder)
    files = sorted((p for p in folder.iterdir() if p.is_file() and p.suffix in _FOLDER_SUFFIXES), key=lambda p: p.name)
    if not files:
        raise RecordError(f"{folder}: no {' or '.join('*' + s for s in _FOLDER_SUFFIXES)} files in the folder")
    return files


def record_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand files and folders into the data files to read, in reading order."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(_folder_files(path))
        elif not path.exists():
            raise RecordError(f"{path}: no such file or folder")
        elif path.suffix in _FILE_SUFFIXES:
            files.append(path)
        else:
            raise RecordError(f"{path}: unknown data file type {path.suffix!r}; expected one of {_FILE_SUFFIXES}")
    return files


def _jsonl_records(path: Path) -> Iterator[Record]:
    row = 0
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path} line {number}: invalid JSON: {e}") from None
            if not isinstance(data, dict):
                raise RecordError(f"{path} line {number}: expected a JSON object, got {type(data).__name__}")
            yield Record(str(path), row, data, line=number)
            row += 1


def _arrow_batches(path: Path) -> Iterator[pa.RecordBatch]:
    with pa.memory_map(str(path)) as source:
        try:
            reader = ipc.open_stream(source)
        except pa.ArrowInvalid:
            # Not every writer uses the stream format; the random-access file format starts with a magic instead.
            source.seek(0)
            file_reader = ipc.open_file(source)
            yield from (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            return
        yield from reader


def _table_records(path: Path, batches: Iterable[pa.RecordBatch]) -> Iterator[Record]:
    row = 0
    for batch in batches:
        for data in batch.to_pylist():
            yield Record(str(path), row, data)
            row += 1


def read_records(paths: Sequence[str | Path]) -> Iterator[Record]:
    """Yield every row of every file of `record_files(paths)`, in order."""
    for path in record_files(paths):
        try:
            if path.suffix in _JSONL:
                yield from _jsonl_records(path)
            elif path.suffix == ".parquet":
                yield from _table_records(path, pq.ParquetFile(path).iter_batches())
            else:
                yield from _table_records(path, _arrow_batches(path))
        except (pa.ArrowException, UnicodeDecodeError) as e:
            raise RecordError(f"{path}: cannot read: {e}") from None
