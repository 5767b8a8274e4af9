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
    problems += context_problems(config, world_size)
    problems += expert_problems(config, world_size)
    replicas = config.parallel.dp_replicate
    if world_size % replicas:
        problems.append(("parallel.dp_replicate", f"{replicas} does not divide the world size {world_size}"))
    cp = config.parallel.cp
    groups = world_size // cp if world_size % cp == 0 else world_size
    per_step = data.micro_batch_tokens * groups
    if data.batch_tokens % per_step:
        what = "world size" if cp == 1 else "data-parallel ranks (world size / parallel.cp)"
        problems.append(
            (
                "data.batch_tokens",
                f"{data.batch_tokens} is not a multiple of data.micro_batch_tokens x {what} "
                f"({data.micro_batch_tokens} x {groups} = {per_step})",
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


CP_ATTENTION = ("auto", "sdpa", "flex", "varlen", "flash")
"""`model.attn` values that run under context parallelism."""


def context_problems(config: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """What stops `parallel.cp` > 1 from working with this config and world size."""
    cp, data = config.parallel.cp, config.data
    if cp == 1:
        return []
    problems = []
    if world_size % cp:
        problems.append(("parallel.cp", f"{cp} does not divide the world size {world_size}"))
    if data.seq_len % (2 * cp):
        problems.append(("data.seq_len", f"{data.seq_len} does not split into 2 x parallel.cp = {2 * cp} equal chunks"))
    if data.micro_batch_tokens % (2 * cp):
        problems.append(
            ("data.micro_batch_tokens", f"{data.micro_batch_tokens} does not split into 2 x parallel.cp = {2 * cp} "
             "equal chunks")
        )  # fmt: skip
    if config.model.attn not in CP_ATTENTION:
        problems.append(("model.attn", f"{config.model.attn!r} does not run under parallel.cp > 1; use "
                         f"{', '.join(CP_ATTENTION)}"))  # fmt: skip
    if config.model.moe_balance.seq_aux_coeff > 0:
        problems.append(("model.moe_balance.seq_aux_coeff", "the sequence-wise balance loss does not run under "
                         "parallel.cp > 1 yet (a segment's tokens are spread over the CP group)"))  # fmt: skip
    return problems


def expert_problems(config: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """What stops `parallel.ep` > 1 from working with this config and world size."""
    ep, arch = config.parallel.ep, config.model.arch
    if ep == 1:
        return []
    problems = []
    if world_size % ep:
        problems.append(("parallel.ep", f"{ep} does not divide the world size {world_size}"))
    experts = getattr(arch, "n_routed_experts", None) or getattr(arch, "num_experts", None)
    if experts is None:
        problems.append(("parallel.ep", f"{ep} needs a mixture-of-experts model (model_type {arch.model_type!r} has "
                         "no routed experts)"))  # fmt: skip
    elif experts % ep:
        problems.append(("parallel.ep", f"{ep} does not divide the {experts} routed experts per MoE block"))
    if world_size == ep and config.model.ac.mode == "selective":
        # Each expert then shards over one rank, and torch's selective checkpointing finds the recomputed forward
        # of such a module different from the first one (a real run stops in its first backward).
        problems.append(("model.ac.mode", f"'selective' does not run with parallel.ep = {ep} equal to the world size "
                         "(each rank's experts unsharded); use 'full', or ep below the world size"))  # fmt: skip
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
