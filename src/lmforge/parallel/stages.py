"""How a pipeline-parallel run cuts the model: which decoder layers each stage holds and which stages each rank
runs (`parallel.pp`, `pp_schedule`, `pp_stages_per_rank`, `pp_layers`). Pure arithmetic, shared by the trainer,
the config checks and `lmforge plan`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

V_SCHEDULES = frozenset({"zbv"})
"""Schedules whose ranks hold their stages in a V (rank r: stages r and 2 pp - 1 - r) instead of in a loop (rank r:
stages r, r + pp, ...)."""


@dataclass(frozen=True)
class PipeShard:
    """This rank's place in the pipeline: its stage group and whether it computes the loss."""

    group: dist.ProcessGroup | None
    """The ranks holding the other stages of this rank's rows (None without pipeline parallelism)."""
    rank: int
    """This rank's index in `group`."""
    size: int
    """`parallel.pp`."""
    loss_rank: int = 0
    """The pipeline rank running the last stage (LM head and loss): pp - 1 in a loop, 0 in a V."""

    @property
    def holds_loss(self) -> bool:
        """Whether this rank runs the last stage, and so sees the step's losses."""
        return self.rank == self.loss_rank


NO_PIPELINE = PipeShard(None, 0, 1)
"""The shard of a run without pipeline parallelism."""


def stages_per_rank(schedule: str, given: int | None) -> int:
    """Stages each rank holds: `given`, else 1 for `1f1b` and 2 for the interleaved and V schedules."""
    if given is not None:
        return given
    return 1 if schedule == "1f1b" else 2


def stage_ranks(pp: int, per_rank: int, schedule: str) -> list[int]:
    """The pipeline rank of every stage, first stage first: a loop (stage s on rank s mod pp) or, for the V
    schedules, down and back up (stages s and 2 pp - 1 - s on rank s)."""
    if schedule in V_SCHEDULES:
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * per_rank)]


def balanced_split(weights: Sequence[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Layers per stage of a contiguous split of layers weighing `weights` into `stages` non-empty stages whose
    heaviest stage is as light as possible, `first` and `last` added to the first and last stage (the embedding
    and the LM head). Ties go to the split with the earliest cuts."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"{n} layers do not split into {stages} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: the lightest heaviest stage over splits of the first i layers into s stages; cut[s][i] its last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                load = prefix[i] - prefix[j] + (first if s == 1 else 0.0) + (last if s == stages else 0.0)
                value = max(best[s - 1][j], load)
                if value < best[s][i] - 1e-9 * max(1.0, value):
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def stage_layers(sizes: Sequence[int]) -> list[range]:
    """The decoder-layer indices of each stage, from the layers per stage."""
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def schedule_bubble(pp: int, per_rank: int, micro_batches: int) -> float:
    """The idle share of a step in theory, with `micro_batches` per rank and step: (p - 1) / (v m + p - 1) for v
    stages per rank (1F1B: v = 1). For the zero-bubble schedules, whose weight gradients fill part of it, this is
    an upper bound."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (per_rank * micro_batches + pp - 1)
