"""Run health: flags for loss and gradient-norm spikes against a running median."""

from __future__ import annotations

import math
import statistics
from collections import deque


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
