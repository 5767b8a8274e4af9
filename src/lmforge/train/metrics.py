"""Per-step statistics: reduced once per step (one SUM and one MAX all-reduce) and turned into metric names."""

from __future__ import annotations

import math
import resource
import sys

import torch
import torch.distributed as dist
from torch import Tensor


def reduce_step_stats(sums: dict[str, Tensor], maxes: dict[str, Tensor]) -> tuple[dict[str, float], dict[str, float]]:
    """All-reduce device scalars (one SUM, one MAX collective) and read them on the host once."""
    device = next(iter({**sums, **maxes}.values())).device

    def stack(values: dict[str, Tensor]) -> Tensor:
        return torch.stack([v.to(device=device, dtype=torch.float64) for v in values.values()]) if values else (
            torch.zeros(0, device=device, dtype=torch.float64))  # fmt: skip

    sum_vec, max_vec = stack(sums), stack(maxes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if sums:
            dist.all_reduce(sum_vec, op=dist.ReduceOp.SUM)
        if maxes:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX)
    host = torch.cat([sum_vec, max_vec]).tolist()
    n = len(sums)
    return dict(zip(sums, host[:n], strict=True)), dict(zip(maxes, host[n:], strict=True))


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process in GiB: allocated CUDA memory, or the resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def perplexity(loss: float) -> float:
    """exp(loss), capped instead of overflowing."""
    return math.exp(min(loss, 80.0))
