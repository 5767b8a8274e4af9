"""The base class of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A TOML section: unknown fields are rejected and each field's docstring is its description."""

    # No field means anything at infinity or NaN (TOML writes them `inf` and `nan`): refuse them where they are set.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )
