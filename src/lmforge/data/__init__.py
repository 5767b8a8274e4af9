"""Data types and the micro-batch contract they share. Knows nothing of models."""

from __future__ import annotations

from lmforge.config.data import DataConfig
from lmforge.data.base import StepData
from lmforge.data.batch import MicroBatch, StepLayout, Window, pack_windows
from lmforge.data.chat import ChatError
from lmforge.data.fake import FakeData
from lmforge.data.sft import SFTData, SFTDataError
from lmforge.data.shards import ShardError
from lmforge.data.tokenizer import TokenizerError, TokenizerInfo, load_tokenizer
from lmforge.data.tokens import TokenData

__all__ = [
    "DataError",
    "MicroBatch",
    "SFTData",
    "SFTDataError",
    "ShardError",
    "StepData",
    "StepLayout",
    "TokenizerError",
    "TokenizerInfo",
    "Window",
    "build_step_data",
    "load_tokenizer",
    "pack_windows",
]

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
