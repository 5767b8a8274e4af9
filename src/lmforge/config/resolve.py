"""A training config from the command line: composed, validated, its architecture filled in from a pretrained
folder (`model.name`), and cross-checked for a world size."""

from __future__ import annotations

from pathlib import Path

from lmforge.config.arch import ArchConfig
from lmforge.config.checks import check_config
from lmforge.config.hf_config import HFModelError, read_hf_config
from lmforge.config.loader import ConfigError, RawConfig, compose, validate
from lmforge.config.train import TrainConfig


def load_train_config(argv: list[str], world_size: int | None = 1) -> tuple[TrainConfig, RawConfig]:
    """Compose, validate and cross-check a training config from `@ file` arguments and flags, for `world_size`
    processes (None: the world size of its [deployment], nodes x processes per node)."""
    raw = compose(argv)
    config = validate(TrainConfig, raw)
    assert isinstance(config, TrainConfig)
    resolve_pretrained(config, raw)
    if world_size is None:
        world_size = config.deployment.num_nodes * config.deployment.procs_per_node
    check_config(config, world_size, raw)
    return config, raw


def _effective(arch: ArchConfig) -> dict[str, object]:
    # Unset head_dim / num_key_value_heads mean their defaults: compare what the model is, not how it was written.
    return {**arch.model_dump(), "head_dim": arch.dim_per_head, "num_key_value_heads": arch.kv_heads}


def resolve_pretrained(config: TrainConfig, raw: RawConfig | None = None) -> None:
    """Fill `model.arch` (and, by default, `tokenizer.name`) from the HF folder that `model.name` names."""
    model = config.model
    src = (raw.source_of("model.name") if raw is not None else None) or "the defaults"
    if model.name is None:
        if model.arch is None:
            raise ConfigError(
                "invalid config:\n  model.arch: required section [model.arch] is missing (or set model.name to a "
                "local Hugging Face model folder)"
            )
        return
    try:
        info = read_hf_config(Path(model.name))
    except HFModelError as e:
        raise ConfigError(f"invalid config:\n  model.name (from {src}): {e}") from None
    if model.arch is not None and _effective(model.arch) != _effective(info.arch):
        mine, theirs = _effective(model.arch), _effective(info.arch)
        diff = ", ".join(f"{k}: {mine.get(k)!r} here vs {theirs.get(k)!r}" for k in sorted(mine | theirs)
                         if mine.get(k) != theirs.get(k))  # fmt: skip
        raise ConfigError(
            f"invalid config:\n  model.arch (from {raw.source_of('model.arch') if raw else None}): differs from "
            f"{model.name}/config.json ({diff}); leave [model.arch] out when model.name is set"
        )
    model.arch = info.arch
    if config.tokenizer.name is None and (Path(model.name) / "tokenizer.json").is_file():
        config.tokenizer.name = model.name
