"""Opening a rank's data stream for a run: check that the data lasts for the planned steps, resume its position,
prepare steps ahead in the background, and summarize what the data holds for the run's first log record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.data.base import StepData
from lmforge.data.prefetch import Prefetcher
from lmforge.data.sft import SFTData, describe
from lmforge.data.tokens import TokenData


@dataclass
class DataSummary:
    """What a data type reports once at startup."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Logged with step 0 (e.g. `data/samples`, `data/overlong`, `data/no_loss_skipped` for SFT)."""
    lines: list[str] = field(default_factory=list)
    """Shown on the console and kept in the log files."""


def open_stream(source: StepData, max_steps: int, step: int, position: dict[str, Any] | None,
                pin_memory: bool = False) -> Prefetcher:  # fmt: skip
    """`source` wrapped in a `Prefetcher`, resumed at `position` (a saved `state_dict`; None starts the stream
    over), after checking that it holds the data steps step+1..max_steps need (raises the data type's error)."""
    if isinstance(source, TokenData):
        # A resumed position counts windows from the run's start; a restarted stream only the remaining steps.
        source.check_budget(max_steps - (step if position is None else 0))
    stream = Prefetcher(source, pin_memory=pin_memory)
    if position is not None:
        stream.load_state_dict(position)
    if isinstance(source, SFTData):
        source.check_budget(max_steps, step)
    return stream


def summarize(source: StepData) -> DataSummary:
    """The startup figures of `source` (empty for data types without any)."""
    if not isinstance(source, SFTData):
        return DataSummary()
    stats, kept = source.samples.stats, len(source.samples)
    metrics = {"data/samples": float(kept), "data/overlong": float(stats.overlong),
               "data/no_loss_skipped": float(stats.no_loss)}  # fmt: skip
    return DataSummary(metrics, [f"data: {describe(stats, kept)}"])
