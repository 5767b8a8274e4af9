"""A training config from the command line: composed, validated, its architecture filled in from a pretrained
folder (`model.name`), and cross-checked for a world size."""

from __future__ import annotations

from pathlib import Path

from lmforge.config.arch import AnyArch, ArchConfig
from lmforge.config.checks import check_config
from lmforge.config.hf_config import HFModelError, read_hf_config
from lmforge.config.loader import ConfigError, RawConfig, compose, validate
from lmforge.config.rope import RopeScaling
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


def extend_context(arch: AnyArch, scaling: RopeScaling) -> AnyArch:
    """`arch` with `scaling` in place of its own RoPE scaling and max_position_embeddings times `scaling.factor`:
    the same weights, read at a longer context."""
    longer = int(arch.max_position_embeddings * scaling.factor)
    return arch.model_copy(update={"rope_scaling": scaling, "max_position_embeddings": longer})


def resolve_pretrained(config: TrainConfig, raw: RawConfig | None = None) -> None:
    """Fill `model.arch` (and, by default, `tokenizer.name`) from the HF folder that `model.name` names."""
    model = config.model
    src = (raw.source_of("model.name") if raw is not None else None) or "the defaults"
    if model.name is None:
        if model.rope_scaling is not None:
            raise ConfigError(
                "invalid config:\n  model.rope_scaling: extends a pretrained model (model.name); a model trained "
                "from scratch sets its scaling in [model.arch.rope_scaling]"
            )
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
    expected = info.arch if model.rope_scaling is None else extend_context(info.arch, model.rope_scaling)
    if model.arch is not None and _effective(model.arch) != _effective(expected):
        mine, theirs = _effective(model.arch), _effective(expected)
        diff = ", ".join(f"{k}: {mine.get(k)!r} here vs {theirs.get(k)!r}" for k in sorted(mine | theirs)
                         if mine.get(k) != theirs.get(k))  # fmt: skip
        raise ConfigError(
            f"invalid config:\n  model.arch (from {raw.source_of('model.arch') if raw else None}): differs from "
            f"{model.name}/config.json ({diff}); leave [model.arch] out when model.name is set"
        )
    model.arch = expected
    if config.tokenizer.name is None and (Path(model.name) / "tokenizer.json").is_file():
        config.tokenizer.name = model.name
