"""Per-step statistics: reduced once per step (one SUM and one MAX all-reduce) and turned into metric names."""

from __future__ import annotations

import math
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def reduce_step_stats(sums: dict[str, Tensor], maxes: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, float]]:
    """All-reduce device values (one SUM, one MAX collective) and read them on the host once.

    Scalars come back as floats; a `sums` entry of another shape (e.g. MoE token counts per layer and expert) is
    summed element-wise in the same collective and comes back as a float64 numpy array of its shape."""
    device = next(iter({**sums, **maxes}.values())).device

    def flat(values: dict[str, Tensor]) -> Tensor:
        parts = [v.to(device=device, dtype=torch.float64).reshape(-1) for v in values.values()]
        return torch.cat(parts) if parts else torch.zeros(0, device=device, dtype=torch.float64)

    sum_vec, max_vec = flat(sums), flat(maxes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if sums:
            dist.all_reduce(sum_vec, op=dist.ReduceOp.SUM)
        if maxes:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX)
    host = torch.cat([sum_vec, max_vec]).cpu().numpy()
    out: dict[str, Any] = {}
    at = 0
    for name, value in sums.items():
        n = value.numel()
        out[name] = float(host[at]) if value.dim() == 0 else host[at : at + n].reshape(tuple(value.shape)).copy()
        at += n
    return out, {name: float(v) for name, v in zip(maxes, host[at:], strict=True)}


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process in GiB: allocated CUDA memory, or the resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def perplexity(loss: float) -> float:
    """exp(loss), capped instead of overflowing."""
    return math.exp(min(loss, 80.0))
