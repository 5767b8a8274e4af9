"""Expert parallelism's parameter layout: each rank keeps only its experts (checkpoints still see whole stacks:
`lmforge.model.expert_parallel.global_view`)."""

from __future__ import annotations

from torch import nn

from lmforge.model.expert_parallel import ExpertShard
from lmforge.model.moe import Experts


def expert_modules(model: nn.Module) -> list[Experts]:
    """The routed-expert modules of `model` (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, Experts)]


def shard_experts(model: nn.Module, shard: ExpertShard) -> list[Experts]:
    """Keep only this rank's experts in every routed-expert module; returns the modules."""
    modules = expert_modules(model)
    for experts in modules:
        experts.shard(shard)
    return modules
