"""When the run saves checkpoints: every `ckpt.interval` steps, at the last step, and on a stop request. How a save
is written and committed is `lmforge.checkpoint.checkpointer`'s job."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.checkpoint.layout import MODEL_FILES
from lmforge.config.ckpt import CkptConfig
from lmforge.data.batch import MicroBatch
from lmforge.parallel.process_group import DistContext
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class Checkpointing(Callback):
    """Checkpoints every `ckpt.interval` steps, at the last step (`ckpt.final`), and after the step at which the
    ranks agreed to stop. On other steps it commits a finished background save. Logs `time/save_ckpt`."""

    def __init__(self, run_dir: Path, cfg: CkptConfig, ctx: DistContext, max_steps: int) -> None:
        """Rank 0 copies the run's config.toml and model/ folder into every checkpoint, so each exports alone."""
        extra = {"config.toml": run_dir / "config.toml", MODEL_FILES: run_dir / MODEL_FILES}
        self.checkpointer = Checkpointer(run_dir, cfg, ctx, extra)
        self.cfg = cfg
        self.max_steps = max_steps

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a checkpoint after `step` (a stop request is checked separately)."""
        if step == self.max_steps and self.cfg.final:
            return True
        return self.cfg.interval is not None and step % self.cfg.interval == 0

    def on_step_start(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """Commit the checkpoint the previous step wrote, now that its metrics are logged; not when they could not
        be (the run stops in this step, and a resume from `latest` replays that step and logs it)."""
        if not trainer.record.failed():
            self.checkpointer.poll()

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Save when due or stopping (the blocked time goes to `time/save_ckpt`), else commit a finished save. The
        save is committed (named by `latest`) once the step's metrics are logged: at the next step's start or at
        the end of training."""
        if self.due(trainer.step) or trainer.stop_agreed:
            metrics["time/save_ckpt"] = self.checkpointer.save(
                trainer.step, trainer.model, trainer.optimizer, trainer.state_dict(), commit=False
            )
            trainer.log.info("checkpoint of step %d (loop blocked %.3f s)", trainer.step, metrics["time/save_ckpt"])
        else:
            self.checkpointer.poll()

    def on_train_end(self, trainer: Trainer) -> None:
        """Finish a background save, so no process exits with its shards half-written."""
        self.checkpointer.close()
