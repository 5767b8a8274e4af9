"""Validation in the loop: the held-out sets every `val.interval` steps and once at the end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.eval.validation import Validator
    from lmforge.train.trainer import Trainer


class Validation(Callback):
    """Runs the held-out sets every `val.interval` steps (and, with `val.eval_on_end`, once after the last step)
    and adds their metrics to the step's."""

    def __init__(self, validator: Validator) -> None:
        """`validator` holds the prepared sets (see `lmforge.eval.validation`)."""
        self.validator = validator
        self.cfg = validator.cfg

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Every `val.interval` steps, add the validation metrics to the step's."""
        if self.cfg.interval and trainer.step % self.cfg.interval == 0:
            metrics.update(self._evaluate(trainer))

    def on_train_end(self, trainer: Trainer) -> None:
        """With `val.eval_on_end`, one round on the final weights, logged at the last step (not after a stop)."""
        if trainer.stopped_by is not None or not self.cfg.eval_on_end:
            return
        if not (self.cfg.interval and trainer.step % self.cfg.interval == 0):
            trainer.record.write(trainer.step, self._evaluate(trainer))

    def _evaluate(self, trainer: Trainer) -> dict[str, float]:
        arrays = self.validator.arrays_dir(trainer.run_dir, trainer.step)
        return self.validator.evaluate(trainer.scorer, trainer.ctx.device, arrays)
