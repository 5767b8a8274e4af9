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
    problems += tensor_problems(config, world_size)
    replicas = config.parallel.dp_replicate
    if world_size % replicas:
        problems.append(("parallel.dp_replicate", f"{replicas} does not divide the world size {world_size}"))
    problems += pipeline_problems(config, world_size)
    split = config.parallel.cp * config.parallel.tp * config.parallel.pp
    groups = world_size // split if world_size % split == 0 else world_size
    per_step = data.micro_batch_tokens * groups
    if data.batch_tokens % per_step:
        what = "world size" if split == 1 else "data-parallel ranks (world size / (parallel.pp x cp x tp))"
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
    if getattr(config.model.arch, "num_nextn_predict_layers", 0):
        problems.append(("parallel.cp", f"{cp}: multi-token prediction (model.arch.num_nextn_predict_layers) reads "
                         "tokens ahead of each position, which another rank of the row may hold; not supported "
                         "yet"))  # fmt: skip
    if config.model.attn not in CP_ATTENTION:
        problems.append(("model.attn", f"{config.model.attn!r} does not run under parallel.cp > 1; use "
                         f"{', '.join(CP_ATTENTION)}"))  # fmt: skip
    return problems


def expert_problems(config: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """What stops `parallel.ep` > 1 from working with this config and world size."""
    ep, arch = config.parallel.ep, config.model.arch
    if ep == 1:
        return []
    problems = []
    if world_size % ep:
        problems.append(("parallel.ep", f"{ep} does not divide the world size {world_size}"))
    experts = arch.moe.num_experts if arch.moe is not None else None
    if experts is None:
        problems.append(("parallel.ep", f"{ep} needs a mixture-of-experts model (model_type {arch.model_type!r} has "
                         "no routed experts)"))  # fmt: skip
    elif experts % ep:
        problems.append(("parallel.ep", f"{ep} does not divide the {experts} routed experts per MoE block"))
    replicas = config.parallel.dp_replicate
    if world_size % replicas == 0 and (world_size // replicas) % ep:
        # each replica group holds whole expert-parallel groups, so the expert stacks replicate as the dense weights
        problems.append(("parallel.ep", f"{ep} does not divide a replica group's {world_size // replicas} ranks "
                         f"(world size / parallel.dp_replicate = {replicas})"))  # fmt: skip
    if world_size == ep and config.model.ac.mode == "selective":
        # Each expert then shards over one rank, and torch's selective checkpointing finds the recomputed forward
        # of such a module different from the first one (a real run stops in its first backward).
        problems.append(("model.ac.mode", f"'selective' does not run with parallel.ep = {ep} equal to the world size "
                         "(each rank's experts unsharded); use 'full', or ep below the world size"))  # fmt: skip
    return problems


def tensor_problems(config: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """What stops `parallel.tp` > 1 from working with this config and world size: each split size must divide by
    tp (the vocabulary, known once the tokenizer is read, is checked when the model is split)."""
    tp, data, arch, parallel = config.parallel.tp, config.data, config.model.arch, config.parallel
    if tp == 1:
        return []
    problems = []
    grid = parallel.dp_replicate * parallel.cp * tp
    if world_size % grid:
        problems.append(("parallel.tp", f"{tp} x parallel.cp x parallel.dp_replicate = {grid} does not divide the "
                         f"world size {world_size}"))  # fmt: skip
    for field, value in (("num_attention_heads", arch.num_attention_heads), ("num_key_value_heads", arch.kv_heads),
                         ("intermediate_size", arch.intermediate_size)):  # fmt: skip
        if value % tp:
            problems.append((f"model.arch.{field}", f"{value} does not divide by parallel.tp = {tp}"))
    # Sequence parallelism splits each rank's share of a row (1 / 2cp chunks under context parallelism) over tp.
    rows = tp * (2 * parallel.cp if parallel.cp > 1 else 1)
    for field, value in (("seq_len", data.seq_len), ("micro_batch_tokens", data.micro_batch_tokens)):
        if value % rows:
            problems.append((f"data.{field}", f"{value} does not split into {rows} equal parts (parallel.tp = {tp}"
                             + (f" x 2 x parallel.cp = {parallel.cp})" if parallel.cp > 1 else ")")))  # fmt: skip
    if config.val.micro_batch_tokens is not None and config.val.micro_batch_tokens % rows:
        problems.append(("val.micro_batch_tokens", f"{config.val.micro_batch_tokens} does not split into {rows} "
                         f"equal parts (parallel.tp = {tp})"))  # fmt: skip
    if arch.mla:
        problems.append(("parallel.tp", f"{tp}: model_type {arch.model_type!r} (multi-head latent attention) does not "
                         "split over tensor parallelism yet; use FSDP, parallel.cp and parallel.ep"))  # fmt: skip
    spec = arch.moe
    if spec is not None and spec.num_shared_experts and (spec.num_shared_experts * spec.intermediate_size) % tp:
        # the shared experts are split like a dense MLP, over their whole width
        problems.append(("model.arch.moe_intermediate_size", f"the shared experts' width {spec.num_shared_experts} x "
                         f"{spec.intermediate_size} does not divide by parallel.tp = {tp}"))  # fmt: skip
    if spec is not None and spec.latent_size and config.model.fp8 != "none":
        # Its projections run on each rank's own tokens, so a float8 scale would cover those tokens only.
        problems.append(("model.fp8", f"{config.model.fp8!r} with a latent MoE (model.arch.moe_latent_size) does "
                         "not run under parallel.tp > 1: the latent projections' float8 scales would differ from "
                         "one process's"))  # fmt: skip
    return problems


ZERO_BUBBLE = frozenset({"interleaved_zb", "zbv"})
"""Pipeline schedules that split each backward into its input and weight parts."""


def pipeline_problems(config: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """What stops `parallel.pp` > 1 from working with this config and world size."""
    parallel, arch, data = config.parallel, config.model.arch, config.data
    pp = parallel.pp
    if pp == 1:
        return [(f"parallel.{name}", f"{getattr(parallel, name)} is set but parallel.pp is 1")
                for name in ("pp_stages_per_rank", "pp_layers") if getattr(parallel, name) is not None]  # fmt: skip
    problems: list[tuple[str, str]] = []
    grid = pp * parallel.dp_replicate * parallel.cp * parallel.tp
    if world_size % grid:
        problems.append(("parallel.pp", f"{pp} x parallel.dp_replicate x parallel.cp x parallel.tp = {grid} does not "
                         f"divide the world size {world_size}"))  # fmt: skip
    ep, group = parallel.ep, world_size // (pp * parallel.dp_replicate) if world_size % grid == 0 else 0
    if ep > 1 and group and group % ep:
        problems.append(("parallel.ep", f"{ep} does not divide a stage group's {group} ranks (world size / "
                         "(parallel.pp x parallel.dp_replicate)): a stage's experts live in its group"))  # fmt: skip
    if ep > 1 and world_size == pp * ep and config.model.ac.mode == "selective":
        problems.append(("model.ac.mode", f"'selective' does not run with each rank's experts unsharded (parallel.ep "
                         f"= {ep} equal to a stage group's ranks); use 'full'"))  # fmt: skip
    if parallel.pp_schedule in ZERO_BUBBLE and config.model.ac.mode == "selective":
        # The split backward (input gradients, then weight gradients) runs autograd twice over each block, which
        # torch's selective checkpointing refuses.
        problems.append(("model.ac.mode", f"'selective' does not run with the {parallel.pp_schedule} schedule (its "
                         "backward runs in two passes); use 'full', or 1f1b / interleaved_1f1b"))  # fmt: skip
    per_rank = parallel.pp_stages_per_rank or (1 if parallel.pp_schedule == "1f1b" else 2)
    if parallel.pp_schedule == "zbv" and per_rank != 2:
        problems.append(("parallel.pp_stages_per_rank", f"{per_rank}: the zbv schedule holds 2 stages per rank"))
    if parallel.pp_schedule == "1f1b" and per_rank != 1:
        problems.append(("parallel.pp_stages_per_rank", f"{per_rank}: the 1f1b schedule holds 1 stage per rank; use "
                         "interleaved_1f1b or interleaved_zb for more"))  # fmt: skip
    stages = pp * per_rank
    if parallel.pp_layers is not None:
        layers = parallel.pp_layers
        if len(layers) != stages or min(layers) < 1 or sum(layers) != arch.num_hidden_layers:
            problems.append(("parallel.pp_layers", f"{layers} must give {stages} stages (parallel.pp x stages per "
                             f"rank) at least one layer each, {arch.num_hidden_layers} in all"))  # fmt: skip
    elif arch.num_hidden_layers < stages:
        problems.append(("parallel.pp", f"{pp} x {per_rank} stages per rank = {stages} stages need at least as many "
                         f"decoder layers; the model has {arch.num_hidden_layers}"))  # fmt: skip
    dp = world_size // (pp * parallel.cp * parallel.tp) if world_size % pp == 0 else world_size
    rows = data.batch_tokens // max(data.micro_batch_tokens * dp, 1)
    if rows < pp or (per_rank > 1 and rows % pp):
        need = "a multiple of" if per_rank > 1 else "at least"
        problems.append(("data.batch_tokens", f"{data.batch_tokens} gives each data-parallel rank {rows} micro-batches "
                         f"a step; the {parallel.pp_schedule} schedule needs {need} parallel.pp = {pp} "
                         "(data.batch_tokens / (data.micro_batch_tokens x world size / parallel.pp))"))  # fmt: skip
    refused = [
        (arch.tie_word_embeddings, "model.arch.tie_word_embeddings", "true: the embedding and the LM head sit in "
         "different stages; untie them"),
        (bool(getattr(arch, "num_nextn_predict_layers", 0)), "model.arch.num_nextn_predict_layers", "set: multi-token "
         "prediction does not run under parallel.pp yet"),
        # The last stage computes its loss outside the model's forward, which is where the z term is added.
        (config.model.z_loss > 0, "model.z_loss", f"{config.model.z_loss}: the z-loss does not run under parallel.pp "
         "yet"),
    ]  # fmt: skip
    problems += [(name, msg) for bad, name, msg in refused if bad]
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
