"""What would make a config that does not fit fit: the largest `data.micro_batch_tokens` (halving, in whole
windows) and the lightest activation checkpointing (`selective`, then `full`, every block) at the configured
micro-batch, each planned again."""

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
