"""Dataset rows from local files: JSON lines, parquet, arrow, `save_to_disk` folders, and the errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from lmforge.data.records import Record, RecordError, read_records, record_files
from tests.conftest import require

ROWS: list[dict[str, Any]] = [
    {"id": i, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(7)
]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 3) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_jsonl_blank_lines_keep_rows_and_line_numbers(tmp_path: Path) -> None:
    lines = [json.dumps(ROWS[0]), "", "   ", json.dumps(ROWS[1]), json.dumps(ROWS[2])]
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    records = list(read_records([path]))
    assert [r.data for r in records] == ROWS[:3]
    assert [r.row for r in records] == [0, 1, 2]
    assert [r.line for r in records] == [1, 4, 5]
    assert {r.source for r in records} == {str(path)}
    assert records[1].where() == f"{path} line 4"


def test_jsonl_invalid_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(ROWS[0]), "", '{"id": 1, "text": '])
    records = read_records([path])
    assert next(records).data == ROWS[0]
    with pytest.raises(RecordError, match=r"bad\.jsonl line 3: invalid JSON"):
        next(records)


@pytest.mark.parametrize(("line", "kind"), [("[1, 2]", "list"), ('"text"', "str"), ("null", "NoneType")])
def test_jsonl_non_object_line(tmp_path: Path, line: str, kind: str) -> None:
    path = write_jsonl(tmp_path / "rows.json", [json.dumps(ROWS[0]), line])
    with pytest.raises(RecordError, match=rf"rows\.json line 2: expected a JSON object, got {kind}"):
        list(read_records([path]))


def test_parquet_rows_count_across_batches(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", ROWS)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    records = list(read_records([str(path)]))
    assert [r.data for r in records] == ROWS
    assert [r.row for r in records] == list(range(len(ROWS)))
    assert records[5] == Record(str(path), 5, ROWS[5])
    assert records[5].where() == f"{path} row 5"


def test_arrow_stream_and_file_formats(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(ROWS)
    stream, file = tmp_path / "stream.arrow", tmp_path / "file.arrow"
    with ipc.new_stream(stream, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    with ipc.new_file(file, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    for path in (stream, file):
        records = list(read_records([path]))
        assert [r.data for r in records] == ROWS
        assert [r.row for r in records] == list(range(len(ROWS)))


def test_folder_mixes_jsonl_and_parquet_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_parquet(folder / "b.parquet", ROWS[2:5])
    write_jsonl(folder / "a.jsonl", [json.dumps(r) for r in ROWS[:2]])
    write_jsonl(folder / "c.jsonl", [json.dumps(r) for r in ROWS[5:]])
    (folder / "notes.txt").write_text("not data")
    (folder / "nested").mkdir()
    write_jsonl(folder / "nested" / "0.jsonl", [json.dumps(ROWS[0])])
    assert [p.name for p in record_files([folder])] == ["a.jsonl", "b.parquet", "c.jsonl"]
    records = list(read_records([folder]))
    assert [r.data for r in records] == ROWS
    assert [(Path(r.source).name, r.row) for r in records] == [
        ("a.jsonl", 0), ("a.jsonl", 1), ("b.parquet", 0), ("b.parquet", 1), ("b.parquet", 2),
        ("c.jsonl", 0), ("c.jsonl", 1),
    ]  # fmt: skip


def test_several_paths_keep_their_order(tmp_path: Path) -> None:
    first = write_parquet(tmp_path / "z.parquet", ROWS[:3])
    second = write_jsonl(tmp_path / "a.jsonl", [json.dumps(r) for r in ROWS[3:]])
    assert record_files([first, second]) == [first, second]
    assert [r.data for r in read_records([first, second])] == ROWS


def test_save_to_disk_folder_with_shards(tmp_path: Path) -> None:
    datasets = require("datasets")
    rows = [{**r, "score": r["id"] / 2, "note": None if r["id"] % 2 else "even"} for r in ROWS]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=2)
    files = record_files([folder])
    assert [p.name for p in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    records = list(read_records([folder]))
    assert [r.data for r in records] == rows
    assert [(Path(r.source).name, r.row) for r in records][3:5] == [
        ("data-00000-of-00002.arrow", 3), ("data-00001-of-00002.arrow", 0),
    ]  # fmt: skip


def test_save_to_disk_follows_state_json_order(tmp_path: Path) -> None:
    # The listed order, not the name order, is the row order of a saved dataset.
    folder = tmp_path / "saved"
    folder.mkdir()
    for name, rows in (("data-b.arrow", ROWS[:3]), ("data-a.arrow", ROWS[3:])):
        table = pa.Table.from_pylist(rows)
        with ipc.new_stream(folder / name, table.schema) as writer:
            writer.write_table(table)
    (folder / "dataset_info.json").write_text("{}")
    listed = [{"filename": "data-b.arrow"}, {"filename": "data-a.arrow"}]
    (folder / "state.json").write_text(json.dumps({"_data_files": listed}))
    assert [r.data for r in read_records([folder])] == ROWS
    (folder / "data-a.arrow").unlink()
    with pytest.raises(RecordError, match=r"state\.json lists data-a\.arrow, which is missing"):
        record_files([folder])


def test_dataset_dict_folder_names_splits(tmp_path: Path) -> None:
    datasets = require("datasets")
    part = datasets.Dataset.from_list(ROWS)
    folder = tmp_path / "dd"
    datasets.DatasetDict(train=part, validation=part).save_to_disk(str(folder))
    with pytest.raises(RecordError, match="DatasetDict with splits train, validation; point at one split folder") as e:
        record_files([folder])
    assert str(folder / "train") in str(e.value)
    assert [r.data for r in read_records([folder / "validation"])] == ROWS


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match=r"nope\.jsonl: no such file or folder"):
        record_files([tmp_path / "nope.jsonl"])


def test_empty_folder(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "readme.md").write_text("no data here")
    with pytest.raises(RecordError, match=rf"{folder}: no \*\.jsonl or \*\.parquet files"):
        record_files([folder])


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(RecordError, match=r"train\.csv: unknown data file type '\.csv'"):
        list(read_records([path]))


def test_corrupt_parquet_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(RecordError, match=r"broken\.parquet: cannot read"):
        list(read_records([path]))
