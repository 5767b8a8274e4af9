"""`loss/spike` and `optim/grad_norm_spike`: flags for loss and gradient-norm spikes against a running median."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any

from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.config.train import LogConfig
    from lmforge.train.trainer import Trainer


class SpikeDetector:
    """Flags a value above `factor` x the median of the last `window` finite values (after `min_history` of them).

    The median ignores the spikes themselves, so one bad step does not raise the bar for the next ones the way a
    mean would. A non-finite value is always a spike and is kept out of the history.
    """

    def __init__(self, factor: float, window: int, min_history: int = 10) -> None:
        self.factor = factor
        self.history: deque[float] = deque(maxlen=window)
        self.min_history = min(min_history, window)

    def update(self, value: float) -> bool:
        """Whether `value` is a spike; then remember it."""
        if not math.isfinite(value):
            return True
        spike = len(self.history) >= self.min_history and value > self.factor * statistics.median(self.history)
        self.history.append(value)
        return spike


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
