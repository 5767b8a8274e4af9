"""Callbacks: the optional parts of a run (checkpoints, eval snapshots, validation, monitors, spike flags, MoE
balancing) plug into the step loop through one base class whose methods all do nothing.

The loop calls them in list order:

    on_train_start                                   once, before the first step (also after a resume)
    per step:  on_step_start -> micro-batches -> step_sums -> one reduction -> on_step_reduced
               -> optimizer update -> after_optimizer_step
    on_train_end                                     once, after the last step (also after a stop request)
    close                                            always, also after an exception

A callback with state that a resumed run needs returns it from `state_dict`; the checkpoint stores it under the
callback's `name` and gives it back through `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lmforge.data.batch import MicroBatch
from lmforge.train.health import SpikeDetector

if TYPE_CHECKING:
    from lmforge.config.train import LogConfig
    from lmforge.eval.validation import Validator
    from lmforge.train.trainer import Trainer


class Callback:
    """A part of the run that the step loop calls at fixed points; every method is a no-op here."""

    name: str = ""
    """Key of this callback's state in a checkpoint (only callbacks with state need one)."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Once before the first step of this process (`trainer.step` > 0 after a resume)."""

    def on_step_start(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """Before the step's first micro-batch."""

    def step_sums(self, trainer: Trainer) -> dict[str, Tensor]:
        """Device values to add to the step's single SUM all-reduce (names must not clash with other parts')."""
        return {}

    def on_step_reduced(self, trainer: Trainer, sums: dict[str, Any]) -> dict[str, float]:
        """After the step's reduction, before the optimizer update; `sums` holds the global values (floats, or
        numpy arrays for non-scalars). Returns metrics of the step."""
        return {}

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After step `trainer.step`'s update, on every rank; may add entries to `metrics` before they are logged."""

    def on_train_end(self, trainer: Trainer) -> None:
        """Once after the loop, on every rank; `trainer.stopped_by` is set when a stop signal ended it early."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this callback (JSON types); empty for none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def close(self) -> None:
        """Release files and threads; runs also when the loop ends with an exception."""


class SpikeFlags(Callback):
    """`loss/spike` and `optim/grad_norm_spike`: the step's loss or gradient norm against the running median of
    the previous ones (`log.loss_spike_factor`, `log.grad_spike_factor`, `log.spike_window`)."""

    name = "spike_flags"

    def __init__(self, cfg: LogConfig) -> None:
        """Detectors for the loss and the gradient norm with the configured factors and window."""
        self.loss = SpikeDetector(cfg.loss_spike_factor, cfg.spike_window)
        self.grad = SpikeDetector(cfg.grad_spike_factor, cfg.spike_window)

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Flag the step's loss and gradient norm."""
        metrics["loss/spike"] = float(self.loss.update(metrics["loss/mean"]))
        metrics["optim/grad_norm_spike"] = float(self.grad.update(metrics["optim/grad_norm"]))

    def state_dict(self) -> dict[str, Any]:
        """The recent values both medians are taken over, so a resumed run flags what the uninterrupted one did."""
        return {"loss": list(self.loss.history), "grad_norm": list(self.grad.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the histories."""
        self.loss.history.extend(state["loss"])
        self.grad.history.extend(state["grad_norm"])


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
            trainer.monitors.log(trainer.step, self._evaluate(trainer))

    def _evaluate(self, trainer: Trainer) -> dict[str, float]:
        arrays = self.validator.arrays_dir(trainer.run_dir, trainer.step)
        return self.validator.evaluate(trainer.model, trainer.ctx.device, arrays)
