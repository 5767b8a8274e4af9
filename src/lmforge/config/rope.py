"""RoPE scaling: the `[model.arch.rope_scaling]` table, which stretches the rotary frequencies so that a model trained
at one context length works at a longer one.

The three kinds are those of transformers' `rope_parameters` (and the older `rope_scaling`), with its field names
and defaults, so a scaled model exports to a `config.json` transformers computes the same frequencies from:

- `linear`: every frequency divided by `factor` (position interpolation);
- `llama3`: Llama 3.1's rule: long wavelengths divided by `factor`, short ones kept, a smooth ramp in between;
- `yarn`: YaRN's per-frequency blend of interpolation and extrapolation, with cos and sin scaled by an attention
  factor.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RopeType = Literal["linear", "llama3", "yarn"]
"""The RoPE scaling kinds lmforge computes."""

_FIELDS_OF: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}


class RopeScaling(BaseModel):
    """How the rotary frequencies are scaled for a context longer than the one the model was trained at."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)

    rope_type: RopeType
    """`linear` (position interpolation), `llama3` (Llama 3.1's frequency-dependent rule) or `yarn` (YaRN)."""

    factor: float = Field(ge=1)
    """How many times longer the new context is than the original one."""

    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    """The context length the model was trained at before scaling (required for `llama3` and `yarn`)."""

    low_freq_factor: float = Field(default=1.0, gt=0)
    """`llama3`: wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""

    high_freq_factor: float = Field(default=4.0, gt=0)
    """`llama3`: wavelengths below original_max_position_embeddings / high_freq_factor are kept as they are."""

    beta_fast: float = Field(default=32.0, gt=0)
    """`yarn`: frequencies turning more than this many times over the original context are extrapolated (kept)."""

    beta_slow: float = Field(default=1.0, gt=0)
    """`yarn`: frequencies turning fewer than this many times over the original context are interpolated."""

    attention_factor: float | None = Field(default=None, gt=0)
    """`yarn`: the factor on cos and sin (so on the attention logits' rotary part); unset: 0.1 ln(factor) + 1, or
    from `mscale` / `mscale_all_dim` when both are set."""

    mscale: float | None = Field(default=None, gt=0)
    """`yarn`: with mscale_all_dim, attention_factor = (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor)
    + 1), as DeepSeek's configs set it."""

    mscale_all_dim: float | None = Field(default=None, gt=0)
    """`yarn`: see `mscale`."""

    truncate: bool = True
    """`yarn`: round the boundaries of the interpolation ramp to whole dimensions (transformers' default)."""

    @model_validator(mode="after")
    def _check_kind(self) -> RopeScaling:
        allowed = _FIELDS_OF[self.rope_type] | {"rope_type"}
        # A field another kind reads is an error when it is given a value of its own; at its default it is what a
        # dump of the whole table (a run's config.toml) writes, and harmless.
        fields = type(self).model_fields
        stray = sorted(f for f in fields if f not in allowed and getattr(self, f) != fields[f].default)
        if stray:
            raise ValueError(f"rope_scaling field(s) {', '.join(stray)} do not apply to rope_type {self.rope_type!r}")
        if self.rope_type != "linear" and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_scaling.original_max_position_embeddings is required for {self.rope_type!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor {self.high_freq_factor} must exceed low_freq_factor "
                f"{self.low_freq_factor}"
            )
        if self.rope_type == "yarn" and self.beta_fast < self.beta_slow:
            raise ValueError(f"rope_scaling.beta_fast {self.beta_fast} must be at least beta_slow {self.beta_slow}")
        return self

    def hf_parameters(self) -> dict[str, Any]:
        """The keys transformers reads for this kind (its `rope_parameters` less the base), every one explicit."""
        keys = sorted(_FIELDS_OF[self.rope_type])
        values = {key: getattr(self, key) for key in keys}
        return {"rope_type": self.rope_type, **{key: value for key, value in values.items() if value is not None}}


def rope_fields_of(rope_type: str) -> frozenset[str]:
    """The fields (besides `rope_type`) a scaling kind reads; empty for a kind lmforge does not compute."""
    return _FIELDS_OF.get(rope_type, frozenset())


def split_rope_parameters(data: Any, partial_rotary: bool) -> Any:
    """An architecture's raw fields with `rope_parameters` (transformers 5's one table for the base, the partial
    rotary factor and the scaling) split into `rope_theta`, `partial_rotary_factor` (for a family that has it:
    `partial_rotary`) and `rope_scaling`; other input is returned as it is."""
    if not isinstance(data, dict) or "rope_parameters" not in data:
        return data
    data = dict(data)
    params = data.pop("rope_parameters")
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a table, got {params!r}")
    params = dict(params)
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in params:
            continue
        value = params.pop(key)
        if key == "partial_rotary_factor" and not partial_rotary and value == 1.0:
            continue  # a whole-head rotation, which every family computes
        if key in data and data[key] != value:
            raise ValueError(f"rope_parameters.{key} {value} contradicts {key} {data[key]}")
        data[key] = value
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        if set(params) - {"rope_type"}:
            raise ValueError(f"rope_parameters of rope_type 'default' take no {', '.join(sorted(params))}")
    elif "rope_scaling" in data:
        raise ValueError("give the scaling in rope_scaling or in rope_parameters, not both")
    else:
        data["rope_scaling"] = params
    return data
