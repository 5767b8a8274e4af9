"""What would make a config that does not fit fit: the largest `data.micro_batch_tokens` (halving, in whole
windows) and the lightest activation checkpointing (`selective`, then `full`, every block) at the configured
micro-batch, each planned again; and for a multi-node step bound by its collectives, what hybrid sharding (one
replica group per node) would change."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from lmforge.config.train import TrainConfig
from lmforge.plan.report import PlanReport


def _with_micro_batch(config: TrainConfig, tokens: int) -> TrainConfig:
    return config.model_copy(update={"data": config.data.model_copy(update={"micro_batch_tokens": tokens})})


def _with_ac(config: TrainConfig, mode: str) -> TrainConfig:
    ac = config.model.ac.model_copy(update={"mode": mode, "freq": 1})
    return config.model_copy(update={"model": config.model.model_copy(update={"ac": ac})})


def smaller_micro_batches(config: TrainConfig) -> Iterator[int]:
    """Micro-batch sizes below the configured one, halving, while they hold whole windows of `data.seq_len`."""
    tokens = config.data.micro_batch_tokens
    while tokens % 2 == 0 and (tokens // 2) % config.data.seq_len == 0:
        tokens //= 2
        yield tokens


def suggestions(config: TrainConfig, plan: Callable[[TrainConfig], PlanReport]) -> list[str]:
    """Changes that make the config fit, each checked by planning it (`plan` plans a config); empty when none of
    them does."""
    found: list[str] = []
    for tokens in smaller_micro_batches(config):
        if plan(_with_micro_batch(config, tokens)).fits:
            found.append(f"--data.micro_batch_tokens {tokens} (the largest that fits; more micro-batches per step)")
            break
    if config.model.ac.mode != "full" or config.model.ac.freq != 1:
        modes = ["selective", "full"] if config.model.ac.mode == "none" else ["full"]
        for mode in modes:
            if plan(_with_ac(config, mode)).fits:
                found.append(f"--model.ac.mode {mode} --model.ac.freq 1 (recomputes activations in backward)")
                break
    return found


def _with_replicas(config: TrainConfig, replicas: int) -> TrainConfig:
    parallel = config.parallel.model_copy(update={"dp_replicate": replicas})
    return config.model_copy(update={"parallel": parallel})


def hybrid_sharding_hint(config: TrainConfig, report: PlanReport, plan: Callable[[TrainConfig], PlanReport]) -> str:
    """For a step of several nodes that plain FSDP leaves bound by its collectives, the plan of the same config
    with one replica group per node (`parallel.dp_replicate`), in one line, when that plans a faster step; empty
    otherwise. Tensor-parallel collectives, which stay inside a node either way, are left out of "bound"."""
    step, world, per_node = report.plan, report.world_size, report.gpus_per_node
    nodes = world // per_node
    overlapped = step.comm_seconds - step.in_line_seconds
    if config.parallel.dp_replicate > 1 or nodes < 2 or world % per_node or overlapped <= step.compute_seconds:
        return ""
    hybrid = plan(_with_replicas(config, nodes))
    if hybrid.plan.step_seconds >= step.step_seconds:
        return ""
    fits = "fits" if hybrid.fits else f"does not fit: {hybrid.shortfall_gib:.2f} GiB over"
    return (f"communication-bound ({step.comm_seconds:.2f} s of collectives against {step.compute_seconds:.2f} s of "
            f"compute): with --parallel.dp_replicate {nodes} (FSDP within each node) the step plans at "
            f"{hybrid.plan.comm_seconds:.2f} s of collectives, {hybrid.plan.step_seconds:.2f} s a step and "
            f"{hybrid.plan.peak_bytes / 2**30:.1f} GiB per GPU ({fits})")  # fmt: skip
