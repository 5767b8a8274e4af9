"""What every monitor implements, and a fan-out that keeps training alive when one fails."""

from __future__ import annotations

import warnings
from typing import Any, Protocol


class Monitor(Protocol):
    """Receives the metrics of logged steps."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of optimizer step `step`."""
        ...

    def close(self) -> None:
        """Flush and release resources at the end of the run."""
        ...


class Monitors:
    """Forwards to several monitors; a monitor that raises is warned about once and then left out."""

    def __init__(self, monitors: list[Any]) -> None:
        self.monitors = list(monitors)

    def _call(self, method: str, *args: Any) -> None:
        for m in list(self.monitors):
            try:
                getattr(m, method)(*args)
            except Exception as e:  # a broken monitor must not stop a week-long run
                warnings.warn(f"monitor {type(m).__name__} failed in {method} and is disabled: {e!r}", stacklevel=2)
                self.monitors.remove(m)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log to every monitor."""
        self._call("log", step, metrics)

    def close(self) -> None:
        """Close every monitor."""
        self._call("close")
