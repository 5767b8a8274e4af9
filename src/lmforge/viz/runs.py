"""Reading a run directory (`config.toml`, `metrics.jsonl`) into series that the plots and the report draw."""

from __future__ import annotations

import fnmatch
import json
import math
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RunError(ValueError):
    """A run directory that cannot be read; the message names the offending path (and line, for metrics.jsonl)."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclass(frozen=True)
class Run:
    """One run directory: its name (the folder name), its resolved config and its logged metric records."""

    path: Path
    name: str
    config_text: str | None  # None when the folder has no config.toml
    config: dict[str, Any]
    records: list[dict[str, Any]] = field(repr=False)

    def metric_names(self) -> list[str]:
        """Sorted names of the metrics that have at least one finite value in this run."""
        return metric_names(self.records)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric; see `series`."""
        return series(self.records, name)


def _is_value(v: object) -> bool:
    # bool is an int subclass, but a flag logged as true/false is not a curve point
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _read_records(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RunError(path, f"cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise RunError(path, f"not UTF-8 text (byte {e.start})") from e
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            # A run still training may be caught halfway through writing its last line: that line is not yet data.
            if number == len(lines) and not text.endswith("\n"):
                break
            raise RunError(path, f"line {number}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise RunError(path, f"line {number}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise RunError(path, f'line {number}: missing or non-integer "step" ({step!r})')
        records.append(record)
    return records


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory; raises `RunError` when it, or its metrics.jsonl, is missing or malformed.

    config.toml is optional (its absence gives `config_text=None` and an empty `config`), but one that is there
    must parse. An unterminated, unparsable last line of metrics.jsonl is ignored, so a live run can be read.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(path, "no such run directory" if not path.exists() else "not a directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise RunError(metrics, "not found; is this a run directory (the output_dir of a training run)?")
    records = _read_records(metrics)
    config_path = path / "config.toml"
    config_text: str | None = None
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config_text = config_path.read_text(encoding="utf-8")
            config = tomllib.loads(config_text)
        except OSError as e:
            raise RunError(config_path, f"cannot read: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise RunError(config_path, f"not UTF-8 text (byte {e.start})") from e
        except (tomllib.TOMLDecodeError, ValueError) as e:  # ValueError: an integer too long for Python to parse
            raise RunError(config_path, f"not valid TOML ({str(e).splitlines()[0]})") from e
    return Run(path=path, name=path.resolve().name, config_text=config_text, config=config, records=records)


def metric_names(records: Iterable[dict[str, Any]]) -> list[str]:
    """Sorted names of the metrics (every key but "step") that have at least one finite value in `records`."""
    names = {k for record in records for k, v in record.items() if k != "step" and _is_value(v)}
    return sorted(names)


def select_metrics(names: Iterable[str], patterns: Sequence[str]) -> dict[str, list[str]]:
    """The names each glob pattern (`fnmatch`, e.g. `val/*/bpb@*`) matches, in sorted order, keyed by pattern.

    A pattern that matches nothing maps to an empty list, so the caller can name it. Matching is case-sensitive:
    metric names are.
    """
    pool = sorted(set(names))
    return {p: [n for n in pool if fnmatch.fnmatchcase(n, p)] for p in patterns}


def series(records: Iterable[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric in step order, skipping records without it and null/non-finite values.

    Should a step have been logged twice, its later record wins.
    """
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(name)
        if _is_value(value):
            by_step[record["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def ema(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction: `weight` in [0, 1) is how much of the past each point keeps.

    s_t = weight * s_{t-1} + (1 - weight) * x_t with s_0 = 0, divided by (1 - weight^t) so that the first points are
    not pulled towards zero. 0 returns the values unchanged; 0.9 averages over roughly the last 10 points. Points
    are weighted by position, not by step: logged steps are evenly spaced.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out: list[float] = []
    running, correction = 0.0, 1.0
    for x in values:
        running = weight * running + (1.0 - weight) * x
        correction *= weight
        out.append(running / (1.0 - correction))
    return out
