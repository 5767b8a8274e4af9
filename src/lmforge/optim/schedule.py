"""The warmup-stable-decay learning-rate multiplier."""

from __future__ import annotations

import math

from lmforge.config.optim import ScheduleConfig


def wsd_multiplier(step: int, max_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (1-based, 1..max_steps).

    Warmup rises linearly to 1 over the first `warmup * max_steps` steps; the last `decay * max_steps` steps fall
    to `end_ratio` along `decay_shape`, reaching it at the last step; the steps in between hold 1.
    """
    warmup_steps = round(cfg.warmup * max_steps)
    decay_steps = round(cfg.decay * max_steps)
    if warmup_steps and step <= warmup_steps:
        return step / warmup_steps
    decay_start = max_steps - decay_steps
    if decay_steps and step > decay_start:
        progress = min(1.0, (step - decay_start) / decay_steps)
        if cfg.decay_shape == "linear":
            shape = 1.0 - progress
        elif cfg.decay_shape == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - math.sqrt(progress)
        return cfg.end_ratio + (1.0 - cfg.end_ratio) * shape
    return 1.0
