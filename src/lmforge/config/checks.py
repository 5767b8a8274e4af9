"""Checks that span several sections or depend on the world size, reported like field errors."""

from __future__ import annotations

from lmforge.config.loader import ConfigError, RawConfig
from lmforge.config.train import TrainConfig


def config_problems(config: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """(dotted field, what is wrong) for every cross-field rule the config breaks."""
    data, arch = config.data, config.model.arch
    problems: list[tuple[str, str]] = []
    if data.micro_batch_tokens % data.seq_len:
        problems.append(
            ("data.micro_batch_tokens", f"{data.micro_batch_tokens} is not a multiple of data.seq_len ({data.seq_len})")
        )
    per_step = data.micro_batch_tokens * world_size
    if data.batch_tokens % per_step:
        problems.append(
            (
                "data.batch_tokens",
                f"{data.batch_tokens} is not a multiple of data.micro_batch_tokens x world size "
                f"({data.micro_batch_tokens} x {world_size} = {per_step})",
            )
        )
    if data.seq_len > arch.max_position_embeddings:
        problems.append(
            (
                "data.seq_len",
                f"{data.seq_len} exceeds model.arch.max_position_embeddings ({arch.max_position_embeddings})",
            )
        )
    if config.model.init.scheme == "completep" and arch.tie_word_embeddings:
        problems.append(
            (
                "model.init.scheme",
                "completep scales the embedding and the LM head differently: it needs tie_word_embeddings = false",
            )
        )
    if data.type == "tokens" and config.tokenizer.name is None:
        problems.append(("tokenizer.name", "required with data.type = 'tokens' (the shards' tokenizer)"))
    if data.type == "sft" and config.tokenizer.name is None:
        problems.append(("tokenizer.name", "required with data.type = 'sft' (or set model.name to a folder with one)"))
    named = [name for name, _ in config.val.files()]
    if named and config.val.data_dir is None:
        problems.append(("val.sets", f"{named} name set files, which need val.data_dir (the folder holding them)"))
    if config.val.data and data.type != "sft":
        problems.append(("val.data", f"held-out samples need data.type = 'sft' (data.type is {data.type!r})"))
    return problems


def check_config(config: TrainConfig, world_size: int, raw: RawConfig | None = None) -> None:
    """Raise one ConfigError listing every cross-field problem, each with the file that set the field."""
    problems = config_problems(config, world_size)
    if not problems:
        return
    lines = []
    for dotted, msg in problems:
        src = raw.source_of(dotted) if raw is not None else None
        lines.append(f"{dotted} (from {src or 'the defaults'}): {msg}")
    raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
