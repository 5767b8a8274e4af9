"""What the trainer needs from a data type."""

from __future__ import annotations

from typing import Any, Protocol

from lmforge.data.batch import MicroBatch


class StepData(Protocol):
    """A stream of this rank's micro-batches, one optimizer step at a time, with a resumable position."""

    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches for the next optimizer step."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position in the stream after the last step handed out (world-size independent)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position returned by state_dict."""
        ...

    @property
    def epoch(self) -> float:
        """Passes over the data so far (fractional); 0 for endless sources."""
        ...
