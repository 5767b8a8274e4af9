"""Planning a pipeline-parallel run (`parallel.pp` > 1): every pipeline rank holds different stages, so the plan
traces one step on a rank of each, through the run's own schedule on fake tensors, and reports the rank with the
highest peak memory, the others' figures beside it, and the slowest rank's step time.

On fake tensors the schedule cannot hold its one-time warm-up vote between neighbouring stages (it reads the vote's
result on the host, which fake tensors do not have), so the plan settles it as every run does: lmforge gives the
stages their input and output shapes (`lmforge.parallel.pipeline.build_pipeline`), which makes them static."""

from __future__ import annotations

from typing import Any

from lmforge.parallel.pipeline import Pipeline

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
