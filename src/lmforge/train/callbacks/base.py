"""The base class of callbacks: the optional parts of a run (checkpoints, eval snapshots, validation, reporting,
spike flags, MoE balancing, mixture source shares) plug into the step loop through it; every method does nothing
here.

The loop calls them in the order `lmforge.train.callbacks.order` declares:

    on_train_start                                   once, before the first step (also after a resume)
    per step:  on_step_data -> on_step_start -> micro-batches -> step_sums -> one reduction -> on_step_reduced
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

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class Callback:
    """A part of the run that the step loop calls at fixed points; every method is a no-op here."""

    name: str = ""
    """Key of this callback's state in a checkpoint (only callbacks with state need one)."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Once before the first step of this process (`trainer.step` > 0 after a resume)."""

    def on_step_data(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """The rank's micro-batches of the step as the data stream gave them: whole rows on the host, before
        context parallelism cuts each into this rank's share."""

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
