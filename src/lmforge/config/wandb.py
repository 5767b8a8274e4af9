"""`[wandb]`: optional logging of a run's metrics to Weights & Biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lmforge.config.base import Section
from lmforge.config.val import check_path_name


class WandbConfig(Section):
    """`[wandb]`: a W&B run that receives the metrics of rank 0; off unless project is set."""

    project: str | None = None
    """W&B project to log to, a plain name (no path separator, not `.` or `..`); unset: W&B is off (and need not
    be installed)."""

    name: str | None = None
    """Display name of the W&B run; unset: the name of output_dir."""

    group: str | None = None
    """W&B group of the run, to compare related runs (a sweep, an ablation) together."""

    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""

    entity: str | None = None
    """W&B user or team that owns the project, a plain name like project; unset: the default entity of the
    logged-in user."""

    mode: Literal["online", "offline", "disabled"] = "online"
    """online: stream to the W&B server; offline: write the run only locally, for a later `wandb sync`;
    disabled: log nothing. Takes precedence over the WANDB_MODE environment variable."""

    dir: str | None = None
    """Folder in which W&B creates its `wandb/` folder of run files; unset: output_dir, so they go to
    `<output_dir>/wandb/`."""

    @field_validator("project", "entity")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        # Both are parts of the paths W&B builds (run URLs, `wandb sync` targets). The run name, group and tags are
        # labels W&B stores as data, never paths, so they stay free text.
        return None if value is None else check_path_name(value)

    @property
    def enabled(self) -> bool:
        """Whether a W&B run is started: a project is set and mode is not disabled."""
        return self.project is not None and self.mode != "disabled"
