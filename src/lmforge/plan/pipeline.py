"""Planning a pipeline-parallel run (`parallel.pp` > 1): every pipeline rank holds different stages, so the plan
traces one step on a rank of each, through the run's own schedule on fake tensors, and reports the rank with the
highest peak memory, the others' figures beside it, and the slowest rank's step time.

On fake tensors the schedule cannot hold its one-time warm-up vote between neighbouring stages (it reads the vote's
result on the host, which fake tensors do not have), so the plan settles it as every run does: lmforge gives the
stages their input and output shapes (`lmforge.parallel.pipeline.build_pipeline`), which makes them static."""

from __future__ import annotations

from typing import Any

from lmforge.config.parallel import ParallelConfig
from lmforge.parallel.pipeline import Pipeline
from lmforge.parallel.stages import schedule_bubble, stages_per_rank

PLANNED_SCHEDULES = frozenset({"1f1b"})
"""Schedules the plan traces. torch's memory tracker follows one forward and backward per module at a time: a rank
with several stages interleaves their micro-batches (its per-module statistics then break), and the zero-bubble
schedules' split backward checks each module's backward from inside `autograd.grad`, which raises."""


def static_shapes(pipeline: Pipeline) -> None:
    """Let `pipeline`'s schedule skip its warm-up vote and take its stages' shapes as given (see the module)."""
    from torch.distributed.pipelining.schedules import InferenceMode

    def settled(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    pipeline.schedule._warmup_p2p = settled


def held_layers(pipeline: Pipeline) -> str:
    """The decoder layers of this rank's stages, e.g. `layers 0-3, layers 8-11`."""
    return ", ".join(f"layers {m.layer_indices.start}-{m.layer_indices.stop - 1}" for m in pipeline.modules)


def pipeline_bubble(parallel: ParallelConfig, micro_batches: int) -> float:
    """The run's schedule's idle share of a step of `micro_batches` per rank, in theory (`schedule_bubble`)."""
    per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    return schedule_bubble(parallel.pp, per_rank, micro_batches)


def pipeline_choice(parallel: ParallelConfig, rank: int, held: str, bubble: float) -> str:
    """The plan's `pipeline` line: the rank, the schedule, the rank's layers and the idle share in theory."""
    return f"rank {rank} of {parallel.pp} ({parallel.pp_schedule}): {held}; {bubble:.1%} of the step idle in theory"


PIPELINE_NOTE = ("pipeline: the stages' point-to-point sends are not in the collective time (one hidden state per "
                 "micro-batch and boundary)")  # fmt: skip
"""What a pipeline plan's collective time leaves out."""
