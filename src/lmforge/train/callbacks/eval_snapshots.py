"""The eval worker's model-only snapshots (`[eval_snapshots]`), written beside the training for `lmforge eval`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.config.ckpt import CkptConfig
from lmforge.parallel.process_group import DistContext
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class EvalSnapshots(Callback):
    """Model-only snapshots for `lmforge eval` every `eval_snapshots.interval` steps and at the last step, written
    in the background on a gloo group of their own. Logs `time/save_snapshot` (the time the loop was blocked)."""

    def __init__(self, run_dir: Path, interval: int, ctx: DistContext, max_steps: int) -> None:
        """Snapshots go to `<run_dir>/snapshots/step_N/`."""
        self.checkpointer = Checkpointer(run_dir, CkptConfig(async_save=True), ctx, {}, model_only=True)
        self.interval = interval
        self.max_steps = max_steps

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Snapshot when due, else commit a finished one."""
        if trainer.step % self.interval == 0 or trainer.step == self.max_steps:
            metrics["time/save_snapshot"] = self.checkpointer.save(trainer.step, trainer.model, None, {})
        else:
            self.checkpointer.poll()

    def on_train_end(self, trainer: Trainer) -> None:
        """Finish the last background write."""
        self.checkpointer.close()
