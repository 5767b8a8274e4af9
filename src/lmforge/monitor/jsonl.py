"""`<output_dir>/metrics.jsonl`: one JSON object per logged step, always written.

It is the run's record: resume, plots, reports and the eval worker read it. A write that fails (a full disk, an
I/O error) is undone, so the file never ends in a torn line, and raises `RecordError`, which stops the run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

from lmforge.monitor.base import RecordError


class JsonlMonitor:
    """Appends `{"step": N, "<metric>": value, ...}` lines, each in full or not at all, straight to the file (no
    buffer), so a crash loses nothing logged."""

    required = True
    """A failure stops the run (see `lmforge.monitor.base`)."""
    name = "jsonl"
    """Name in messages."""

    def __init__(self, path: Path) -> None:
        """Open `path` for appending (creating its folder); a failure raises `RecordError`."""
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab", buffering=0)
            self._whole = os.fstat(self._file.fileno()).st_size
        except OSError as e:
            raise RecordError(f"opening {path} failed: {type(e).__name__}: {e}") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one line; non-finite floats are written as null (JSON has no NaN)."""
        record = {"step": step}
        record.update({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()})
        line = memoryview((json.dumps(record) + "\n").encode("utf-8"))
        try:
            while line:
                written = self._file.write(line)
                line = line[written or 0 :]
        except OSError as e:
            self._undo()
            raise RecordError(f"writing {self.path} failed at step {step}: {type(e).__name__}: {e}") from None
        self._whole = os.fstat(self._file.fileno()).st_size

    def _undo(self) -> None:
        """Cut off what a failed write left of its line (shrinking a file needs no space)."""
        with contextlib.suppress(OSError):  # else the file keeps a torn last line, which `read_metrics` leaves out
            os.ftruncate(self._file.fileno(), self._whole)

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """All records of a metrics.jsonl file, in order. A torn last line (a write cut off by a crash or a full disk
    that could not be undone) is left out; a bad line anywhere else is an error."""
    with path.open(encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise
    return records
