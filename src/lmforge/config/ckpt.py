"""`[ckpt]` and `[resume]`: when checkpoints are written and kept, and where a run continues from."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from lmforge.config.base import Section


class CkptConfig(Section):
    """`[ckpt]`: sharded checkpoints under `<output_dir>/checkpoints/step_N/`."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    interval: int | None = Field(default=None, ge=1)
    """Write a checkpoint every interval steps; unset: only the final one (and one on preemption)."""

    final: bool = True
    """Write a checkpoint after the last step."""

    keep_last: int = Field(default=2, ge=1)
    """Keep the keep_last newest checkpoints and delete older ones (except those keep_interval keeps)."""

    keep_interval: int | None = Field(default=None, ge=1)
    """Also keep, forever, every checkpoint whose step is a multiple of keep_interval."""

    async_save: bool = Field(default=False, alias="async")
    """Write checkpoints in the background (the key is `async`; `async_save` is accepted too): the step loop waits
    only while the state is copied to host memory, and the files are written in a background thread; the checkpoint
    becomes `latest` when they are complete."""


class ResumeConfig(Section):
    """`[resume]`: continue a run from one of its checkpoints."""

    step: int | Literal["latest", "auto"] | None = None
    """Checkpoint to resume from: a step number, `latest` (the newest complete checkpoint; an error if there is
    none) or `auto` (the newest if there is one, else start from scratch: relaunch-safe). Unset: start from
    scratch."""

    path: str | None = None
    """Run directory (or one `checkpoints/step_N` folder) to resume from; unset: this run's output_dir."""

    skip_optimizer: bool = False
    """Load only the model weights; the optimizer starts fresh (moments at zero)."""

    skip_scheduler: bool = False
    """Restart the learning-rate schedule at the resumed step: a new warmup and decay over the remaining steps."""

    skip_data: bool = False
    """Start the data stream from its beginning instead of after the last window the checkpoint consumed."""
