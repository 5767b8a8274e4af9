"""Which ranks a plan traces: rank 0, whose step stands for every rank's when all hold the same layers, or under
pipeline parallelism the first rank of every pipeline rank's stage group, since each holds different stages.

A pipeline rank's step costs the plan in proportion to its micro-batches (every one runs through the schedule), so
with more than a few the plan traces two shorter steps instead, n and 2n micro-batches with n = 2 pp (twice what
1F1B holds in flight, so both have its steady phase: the first rank holds as many in flight as in the run, and its
temporaries are the steady phase's), and extends every figure along the line
through them to the run's count: the compute and the tensor-parallel collectives grow by one micro-batch's worth
per micro-batch, the memory by what torch's stages keep per micro-batch, and FSDP's collectives, once per step
under pipeline parallelism, not at all."""

from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from lmforge.config.parallel import ParallelConfig
from lmforge.config.train import TrainConfig
from lmforge.parallel.stages import stages_per_rank
from lmforge.plan.collectives import Traffic
from lmforge.plan.gpus import GpuSpec
from lmforge.plan.pipeline import PLANNED_SCHEDULES, pipeline_bubble, pipeline_choice
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
    parallel = config.parallel
    pp = parallel.pp
    if pp == 1:
        return plan_step(config, world_size, gpu, gpus_per_node, doc_len, vocab_size)
    if parallel.pp_schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule = {parallel.pp_schedule!r}: the plan traces "
                         f"{', '.join(sorted(PLANNED_SCHEDULES))} only (torch's memory tracker cannot follow a rank's "
                         "interleaved stages or a split backward); plan the layout with 1f1b and the same layers "
                         "per rank: the interleaved and zero-bubble schedules hold somewhat more activations, and "
                         "the zero-bubble ones also their deferred weight gradients")  # fmt: skip
    data = config.data
    dp = world_size // (pp * parallel.cp * parallel.tp)
    rows = data.batch_tokens // (data.micro_batch_tokens * dp)
    # Twice the micro-batches the schedule holds in flight: a step of exactly that many has no steady phase.
    short = 2 * pp * stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    counts = [rows] if rows <= 2 * short else [short, 2 * short]
    # Each plan runs in a fresh process: a device mesh compares equal to one of the same layout from an earlier
    # fake world, and torch hands the earlier one (whose process groups are gone) back to later worlds of one
    # process.
    plans = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        for r in range(pp):
            traced = [pool.submit(plan_step, _with_micro_batches(config, n, dp), world_size, gpu, gpus_per_node,
                                  doc_len, vocab_size, rank=r * (world_size // pp)) for n in counts]  # fmt: skip
            done = [t.result() for t in traced]
            plans.append(done[0] if len(done) == 1 else _extended(done[0], done[1], rows, r, parallel))
    ranks = [{"pipeline_rank": r, "layers": p.held_layers, "peak_bytes": p.peak_bytes,
              "busy_seconds": p.busy_seconds, "step_seconds": p.step_seconds} for r, p in enumerate(plans)]  # fmt: skip
    worst = max(plans, key=lambda p: p.peak_bytes)
    worst.pipeline_ranks = ranks
    return worst


def _with_micro_batches(config: TrainConfig, n: int, dp: int) -> TrainConfig:
    """`config` with steps of `n` micro-batches per data-parallel rank."""
    data = config.data.model_copy(update={"batch_tokens": n * config.data.micro_batch_tokens * dp})
    return config.model_copy(update={"data": data})


def _extended(short: StepPlan, long: StepPlan, rows: int, rank: int, parallel: ParallelConfig) -> StepPlan:
    """The plan of pipeline rank `rank`'s step of `rows` micro-batches per rank along the line through the plans of
    two shorter ones."""
    n1, n2 = short.micro_batches, long.micro_batches
    k = (rows - n1) / (n2 - n1)

    def line(a: float, b: float) -> float:
        return a + (b - a) * k

    def traffic(a: Traffic, b: Traffic) -> Traffic:
        return Traffic(round(line(a.calls, b.calls)), line(a.buffer_bytes, b.buffer_bytes),
                       line(a.sent_bytes, b.sent_bytes), line(a.seconds, b.seconds))  # fmt: skip

    bubble = pipeline_bubble(parallel, rows)
    choices = {**long.choices, "pipeline": pipeline_choice(parallel, rank, long.held_layers, bubble)}
    memory = {name: line(short.memory.get(name, 0.0), size) for name, size in long.memory.items()}
    kinds = short.comms.keys() | long.comms.keys()
    return dataclasses.replace(
        long, memory=memory, peak_bytes=sum(memory.values()), tokens=round(line(short.tokens, long.tokens)),
        flops=line(short.flops, long.flops), dense_flops=line(short.dense_flops, long.dense_flops),
        traced_flops=line(short.traced_flops, long.traced_flops), compute_seconds=line(short.compute_seconds,
        long.compute_seconds), comms={k: traffic(short.comms.get(k, Traffic()), long.comms.get(k, Traffic()))
                                      for k in kinds},
        comm_seconds=line(short.comm_seconds, long.comm_seconds),
        in_line_seconds=line(short.in_line_seconds, long.in_line_seconds), micro_batches=rows, bubble=bubble,
        choices=choices, notes=[*long.notes, f"pipeline: traced steps of {n1} and {n2} micro-batches per rank and "
                                f"extended every figure along their line to the step's {rows}"],
    )  # fmt: skip
