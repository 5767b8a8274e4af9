"""Architecture configs: the `[model.arch]` section, one class per `model_type`.

Field names follow the Hugging Face config classes of the same family, so an architecture written here
maps one to one onto the `config.json` of the exported model.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _ArchBase(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    hidden_size: int = Field(gt=0)
    """Width of the residual stream."""

    intermediate_size: int = Field(gt=0)
    """Hidden width of the SwiGLU MLP."""

    num_hidden_layers: int = Field(gt=0)
    """Number of decoder blocks."""

    num_attention_heads: int = Field(gt=0)
    """Number of query heads."""

    num_key_value_heads: int | None = Field(default=None, gt=0)
    """Number of key/value heads (grouped-query attention); unset means one per query head."""

    head_dim: int | None = Field(default=None, gt=0)
    """Width of one attention head; unset means hidden_size // num_attention_heads."""

    max_position_embeddings: int = Field(default=4096, gt=0)
    """Longest sequence the model is built for; data.seq_len may not exceed it."""

    rope_theta: float = Field(default=10000.0, gt=0)
    """Base of the rotary position embedding frequencies."""

    rms_norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon of every RMSNorm."""

    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the LM head."""

    attention_bias: bool = False
    """Give the q/k/v/o projections a bias."""

    @model_validator(mode="after")
    def _check_heads(self) -> _ArchBase:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; set head_dim explicitly"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.dim_per_head % 2:
            raise ValueError(f"head_dim {self.dim_per_head} must be even for rotary embeddings")
        return self

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads after applying the default."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        """Width of one head after applying the default."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalized per head before RoPE."""
        return False


class LlamaArch(_ArchBase):
    """A Llama decoder (`LlamaForCausalLM`)."""

    model_type: Literal["llama"] = "llama"
    """Architecture family: a Llama decoder."""


class Qwen3Arch(_ArchBase):
    """A Qwen3 decoder (`Qwen3ForCausalLM`): Llama plus per-head RMSNorm on queries and keys."""

    model_type: Literal["qwen3"] = "qwen3"
    """Architecture family: a Qwen3 decoder (Llama with QK-norm)."""

    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of every RMSNorm, the QK-norms included."""

    rope_theta: float = Field(default=1_000_000.0, gt=0)
    """Base of the rotary position embedding frequencies."""

    @property
    def qk_norm(self) -> bool:
        """Qwen3 always normalizes queries and keys per head."""
        return True


ArchConfig = Annotated[LlamaArch | Qwen3Arch, Field(discriminator="model_type")]
"""Any architecture, chosen by its `model_type` field."""
