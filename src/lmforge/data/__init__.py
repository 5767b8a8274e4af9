"""Data types and the micro-batch contract they share. Knows nothing of models."""

from __future__ import annotations

from lmforge.config.data import DataConfig
from lmforge.data.base import StepData
from lmforge.data.batch import MicroBatch, StepLayout, Window, pack_windows
from lmforge.data.fake import FakeData

__all__ = ["MicroBatch", "StepData", "StepLayout", "Window", "build_step_data", "pack_windows"]


def build_step_data(cfg: DataConfig, rank: int, world_size: int) -> StepData:
    """The data stream of `cfg` for one rank."""
    if cfg.type == "fake":
        return FakeData(cfg, rank, world_size)
    raise ValueError(f"unknown data type {cfg.type!r}")
