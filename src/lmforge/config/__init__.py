"""Config sections (pydantic), the `[model.arch]` schemas and their Hugging Face `config.json` mapping, and the
loader that composes TOML files and flags into a `TrainConfig`. Nothing here imports torch or another part of
lmforge: every command can check a config before it loads anything heavy."""

from __future__ import annotations

from lmforge.config.arch import AnyArch, ArchConfig
from lmforge.config.ckpt import CkptConfig, ResumeConfig
from lmforge.config.data import DataConfig, FakeDataConfig, SFTDataConfig, TokensDataConfig
from lmforge.config.loader import ConfigError, RawConfig, compose, dump_toml, validate
from lmforge.config.model import ACConfig, InitConfig, ModelConfig
from lmforge.config.optim import AdamWConfig, MuonConfig, OptimConfig, ScheduleConfig
from lmforge.config.resolve import load_train_config, resolve_pretrained
from lmforge.config.train import LogConfig, TokenizerConfig, TrainConfig

__all__ = [
    "ACConfig",
    "AdamWConfig",
    "AnyArch",
    "ArchConfig",
    "CkptConfig",
    "ConfigError",
    "DataConfig",
    "FakeDataConfig",
    "InitConfig",
    "LogConfig",
    "ModelConfig",
    "MuonConfig",
    "OptimConfig",
    "RawConfig",
    "ResumeConfig",
    "SFTDataConfig",
    "ScheduleConfig",
    "TokenizerConfig",
    "TokensDataConfig",
    "TrainConfig",
    "compose",
    "dump_toml",
    "load_train_config",
    "resolve_pretrained",
    "validate",
]
