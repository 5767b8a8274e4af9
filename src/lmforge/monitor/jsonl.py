"""`<output_dir>/metrics.jsonl`: one JSON object per logged step, always written."""

from __future__ import annotations

import json
import math
from pathlib import Path


class JsonlMonitor:
    """Appends `{"step": N, "<metric>": value, ...}` lines and flushes each, so a crash loses nothing logged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one line; non-finite floats are written as null (JSON has no NaN)."""
        record = {"step": step}
        record.update({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """All records of a metrics.jsonl file, in order."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
