"""Config sections (pydantic) and the loader that composes TOML files and flags into a `TrainConfig`."""

from __future__ import annotations

from lmforge.config.checks import check_config
from lmforge.config.data import DataConfig, FakeDataConfig, TokensDataConfig
from lmforge.config.loader import ConfigError, RawConfig, compose, dump_toml, validate
from lmforge.config.model import ACConfig, InitConfig, ModelConfig
from lmforge.config.optim import AdamWConfig, OptimConfig, ScheduleConfig
from lmforge.config.train import LogConfig, TokenizerConfig, TrainConfig

__all__ = [
    "ACConfig",
    "AdamWConfig",
    "ConfigError",
    "DataConfig",
    "FakeDataConfig",
    "InitConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "RawConfig",
    "ScheduleConfig",
    "TokenizerConfig",
    "TokensDataConfig",
    "TrainConfig",
    "dump_toml",
    "load_train_config",
]


def load_train_config(argv: list[str], world_size: int = 1) -> tuple[TrainConfig, RawConfig]:
    """Compose, validate and cross-check a training config from `@ file` arguments and flags."""
    raw = compose(argv)
    config = validate(TrainConfig, raw)
    assert isinstance(config, TrainConfig)
    check_config(config, world_size, raw)
    return config, raw
