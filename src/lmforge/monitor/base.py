"""What every monitor implements, and the fan-out that sends each logged step to all of them.

The run's record (`metrics.jsonl`) is never allowed to go silent: a monitor marked `required` that fails raises
`RecordError`, and the trainer stops the run the way a failed checkpoint does. Any other monitor (W&B, the console)
is kept and called again at the next step; its failures are counted in `monitor/failures/<name>`, which is logged
with every later step and shown in the console line, and the first one is warned about.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol


class RecordError(Exception):
    """A write to the run's record (metrics.jsonl, a rank log) failed; the message names the file and the cause."""


class Monitor(Protocol):
    """Receives the metrics of logged steps."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of optimizer step `step`."""
        ...

    def close(self) -> None:
        """Flush and release resources at the end of the run."""
        ...


def monitor_name(monitor: Any) -> str:
    """The short name of a monitor in `monitor/failures/<name>` (its `name`, else its class name)."""
    return str(getattr(monitor, "name", type(monitor).__name__.lower()))


class Monitors:
    """Forwards to several monitors: a failing `required` one raises `RecordError`, another one is counted (see the
    module docstring)."""

    def __init__(self, monitors: list[Any]) -> None:
        self.monitors = list(monitors)
        self.failures: dict[str, int] = {}
        """Failed calls of each optional monitor so far, by name."""

    def _call(self, method: str, *args: Any) -> None:
        for m in self.monitors:
            try:
                getattr(m, method)(*args)
            except RecordError:
                raise
            except Exception as e:
                name = monitor_name(m)
                if getattr(m, "required", False):
                    raise RecordError(f"monitor {name} failed in {method}: {type(e).__name__}: {e}") from e
                if name not in self.failures:
                    warnings.warn(f"monitor {name} failed in {method}: {e!r}; training goes on, and its failures "
                                  f"are counted in monitor/failures/{name}", stacklevel=3)  # fmt: skip
                self.failures[name] = self.failures.get(name, 0) + 1

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log to every monitor, with the failure counts of the optional ones so far."""
        counts = {f"monitor/failures/{name}": float(n) for name, n in self.failures.items()}
        self._call("log", step, {**metrics, **counts})

    def close(self) -> None:
        """Close every monitor."""
        self._call("close")
