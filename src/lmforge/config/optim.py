"""`[optim]` and `[schedule]`: the optimizer and the learning-rate multiplier over the run."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from lmforge.config.base import Section


class AdamWConfig(Section):
    """`optim.type = "adamw"`: decoupled weight decay Adam (fused on CUDA)."""

    type: Literal["adamw"] = "adamw"
    """Optimizer: AdamW."""

    lr: float = Field(gt=0)
    """Peak learning rate (the schedule multiplies it)."""

    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay of weight matrices and embeddings; norms and biases are never decayed."""

    beta1: float = Field(default=0.9, ge=0, lt=1)
    """First-moment decay."""

    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Second-moment decay."""

    eps: float = Field(default=1e-8, gt=0)
    """Denominator epsilon."""

    max_norm: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 turns clipping off (the norm is still logged)."""


def _optim_tag(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "adamw")
    return getattr(value, "type", "adamw")


OptimConfig = Annotated[Annotated[AdamWConfig, Tag("adamw")], Discriminator(_optim_tag)]
"""Any optimizer, chosen by its `type` field (default adamw)."""


class ScheduleConfig(Section):
    """`[schedule]`: warmup-stable-decay (WSD), one multiplier on every parameter group's learning rate."""

    warmup: float = Field(default=0.05, ge=0, le=1)
    """Fraction of max_steps over which the multiplier rises linearly from 0 to 1."""

    decay: float = Field(default=0.2, ge=0, le=1)
    """Fraction of max_steps, at the end of the run, over which the multiplier falls to end_ratio."""

    end_ratio: float = Field(default=0.0, ge=0, le=1)
    """Multiplier at the last step."""

    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay: linear, half cosine, or 1 - sqrt."""

    @model_validator(mode="after")
    def _fractions_fit(self) -> ScheduleConfig:
        if self.warmup + self.decay > 1:
            raise ValueError(f"warmup ({self.warmup}) + decay ({self.decay}) must not exceed 1")
        return self
