"""A rank's data stream for a run: the configured data type for this rank (`build_step_data`), opened to check that
it lasts for the planned steps, resume its position and prepare steps ahead in the background (`open_stream`), and
summarized for the run's first log record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.config.data import DataConfig
from lmforge.data.base import StepData
from lmforge.data.chat import ChatError
from lmforge.data.fake import FakeData
from lmforge.data.prefetch import Prefetcher
from lmforge.data.sft import SFTData, SFTDataError, describe
from lmforge.data.shards import ShardError
from lmforge.data.tokenizer import TokenizerError, TokenizerInfo
from lmforge.data.tokens import TokenData

DataError = (ShardError, TokenizerError, SFTDataError, ChatError)
"""Errors in the data or tokenizer a run was given: reported as a message, not a traceback."""


def build_step_data(cfg: DataConfig, rank: int, world_size: int, tokenizer: TokenizerInfo | None = None) -> StepData:
    """The data stream of `cfg` for one rank."""
    if cfg.type == "fake":
        return FakeData(cfg, rank, world_size)
    if cfg.type == "tokens":
        if tokenizer is None:
            raise TokenizerError("data.type = 'tokens' needs tokenizer.name")
        return TokenData(cfg, rank, world_size, tokenizer)
    if cfg.type == "sft":
        if tokenizer is None:
            raise TokenizerError("data.type = 'sft' needs tokenizer.name")
        return SFTData(cfg, rank, world_size, tokenizer)
    raise ValueError(f"unknown data type {cfg.type!r}")


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
