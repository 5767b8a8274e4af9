"""Which ranks a plan traces: rank 0, whose step stands for every rank's when all hold the same layers, or under
pipeline parallelism the first rank of every pipeline rank's stage group, since each holds different stages."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from lmforge.config.train import TrainConfig
from lmforge.plan.gpus import GpuSpec
from lmforge.plan.pipeline import PLANNED_SCHEDULES
from lmforge.plan.step import StepPlan, plan_step


def plan_run(
    config: TrainConfig,
    world_size: int,
    gpu: GpuSpec,
    gpus_per_node: int,
    doc_len: float | None = None,
    vocab_size: int | None = None,
) -> StepPlan:
    """The plan of one step of `config` on `world_size` GPUs (`plan_step`). Under pipeline parallelism: the plan of
    the pipeline rank with the highest peak memory, with every pipeline rank's peak, busy time and step time in
    `pipeline_ranks`, its step time the slowest rank's. Raises ValueError for a schedule the plan cannot trace."""
    pp = config.parallel.pp
    if pp == 1:
        return plan_step(config, world_size, gpu, gpus_per_node, doc_len, vocab_size)
    if config.parallel.pp_schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule = {config.parallel.pp_schedule!r}: the plan traces "
                         f"{', '.join(sorted(PLANNED_SCHEDULES))} only (torch's memory tracker cannot follow a rank's "
                         "interleaved stages or a split backward); plan the layout with 1f1b and the same layers "
                         "per rank: the interleaved and zero-bubble schedules hold somewhat more activations, and "
                         "the zero-bubble ones also their deferred weight gradients")  # fmt: skip
    # Each pipeline rank's plan runs in a fresh process: a device mesh compares equal to one of the same layout
    # from an earlier fake world, and torch hands the earlier one (whose process groups are gone) back to later
    # worlds of one process.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        plans = [pool.submit(plan_step, config, world_size, gpu, gpus_per_node, doc_len, vocab_size,
                             rank=r * (world_size // pp)).result() for r in range(pp)]  # fmt: skip
    ranks = [{"pipeline_rank": r, "layers": p.held_layers, "peak_bytes": p.peak_bytes,
              "busy_seconds": p.busy_seconds, "step_seconds": p.step_seconds} for r, p in enumerate(plans)]  # fmt: skip
    worst = max(plans, key=lambda p: p.peak_bytes)
    worst.pipeline_ranks = ranks
    return worst
