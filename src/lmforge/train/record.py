"""The run's record on this rank: what the monitors write (metrics.jsonl on rank 0) and the rank's log file.

The record must not go silent. A failed write is kept here instead of ending the step where it happens; the trainer
adds "failed" to the next step's MAX reduction, so every rank learns of it together and stops before that step's
update, and checkpointing commits nothing after the last recorded step. A relaunch from `latest` replays the
unrecorded steps and logs them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.checkpoint.layout import CHECKPOINTS, read_latest, step_name
from lmforge.monitor import Monitors, RecordError
from lmforge.parallel.process_group import DistContext
from lmforge.train.logs import log_failure


class RunRecord:
    """This rank's monitors and log file, and the first write to either that failed."""

    def __init__(self, monitors: Monitors, log: logging.Logger, ctx: DistContext, run_dir: Path) -> None:
        """`monitors` (empty off rank 0) and `log` are the trainer's; `run_dir` says where the checkpoints are."""
        self.monitors, self.log, self.ctx, self.run_dir = monitors, log, ctx, run_dir
        self.failure: str | None = None
        """The first failed write of this rank's record (None while every one succeeded)."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Send a step's metrics to the monitors; a failed write of metrics.jsonl is kept (see the module)."""
        try:
            self.monitors.log(step, metrics)
        except RecordError as e:
            self.failure = self.failure or str(e)

    def failed(self) -> bool:
        """Whether a write of this rank's record (metrics.jsonl, its log file) has failed."""
        self.failure = self.failure or log_failure(self.log)
        return self.failure is not None

    def stopped(self, step: int, agreed: bool = True) -> RecordError:
        """The error that ends the run after `step` once some rank's record failed: with `agreed` (every rank calls
        this together) the first failure of any rank, else this rank's own; with the checkpoint to continue from."""
        failures = [self.failure]
        if agreed and self.ctx.world_size > 1:
            failures = [None] * self.ctx.world_size
            dist.all_gather_object(failures, self.failure)
        rank, failure = next((r, f) for r, f in enumerate(failures) if f is not None)
        latest = read_latest(self.run_dir / CHECKPOINTS)
        resume = (f"continue from {step_name(latest)} with --resume.step latest once the disk has room"
                  if latest is not None else "no checkpoint was committed: the run starts over")  # fmt: skip
        where = f" (on rank {rank})" if self.ctx.world_size > 1 else ""
        return RecordError(f"{failure}{where}; the run record must not go silent, so training stopped after step "
                           f"{step}: {resume}")  # fmt: skip

    def agree(self, step: int) -> None:
        """After the last step, before the end of training commits its checkpoint: raise on every rank if any
        rank's record failed (one MAX all-reduce)."""
        failed = torch.tensor(float(self.failed()), device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() > 0:
            raise self.stopped(step)
