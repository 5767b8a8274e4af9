"""Step hooks: optional features (validation, MoE balancing, eval snapshots) plug into the loop here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class StepHook(Protocol):
    """Called by the trainer around its step loop; every method is optional."""

    def after_optimizer_step(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """Runs after step `step`'s update, on every rank; may add entries to `metrics` before they are logged."""
        ...

    def on_train_end(self, trainer: Trainer) -> None:
        """Runs once after the last step, on every rank."""
        ...
