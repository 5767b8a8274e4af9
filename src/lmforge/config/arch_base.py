"""What every architecture config shares: the `ArchBase` fields (width, heads, RoPE, norms), the layer kinds, and
`MoESpec`, an MoE block's computation independent of each family's field names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmforge.config.rope import RopeScaling, split_rope_parameters

LayerType = Literal["full_attention", "sliding_attention"]
"""The attention of one decoder block, as transformers' `layer_types` name it."""

MlpAct = Literal["silu", "relu2"]
"""The activation on the gate half of a dense gated MLP, as transformers' `hidden_act` names it: `silu` (SwiGLU)
or `relu2` (ReLU squared)."""


@dataclass(frozen=True)
class MoESpec:
    """What an MoE block computes, independent of the family's config field names."""

    num_experts: int
    """Routed experts."""
    top_k: int
    """Routed experts per token."""
    intermediate_size: int
    """Hidden width of one expert's SwiGLU (shared experts too)."""
    score_func: Literal["sigmoid", "softmax"]
    """How router logits become scores: per-expert sigmoid (GLM-4.5) or softmax over experts (Qwen3-MoE)."""
    selection_bias: bool
    """Add the `e_score_correction_bias` buffer to the scores when choosing experts (not to the gate values)."""
    norm_topk_prob: bool
    """Rescale the chosen scores to sum to one."""
    routed_scaling_factor: float
    """Multiplier on the gate values after the optional rescaling."""
    num_shared_experts: int
    """Always-on experts, run as one SwiGLU of num_shared_experts x intermediate_size (0: none)."""
    null_experts: int = 0
    """Zero-computation experts the router may choose besides the routed ones (indices num_experts and up)."""
    bias_on_logits: bool = False
    """Add the selection bias to the router's logits instead of its scores when choosing experts."""
    latent_size: int = 0
    """Width the routed experts work in (LatentMoE): tokens are projected to it before dispatch and their gated sum
    back to the hidden size after; 0: the hidden size, without projections."""
    expert_glu: Literal["swiglu", "situ_glu", "clamped_swiglu"] = "swiglu"
    """The routed experts' gated activation: silu(gate) x up, Kimi K3's SiTU-GLU, or gpt-oss's clamped SwiGLU."""
    situ_betas: tuple[float, float] = (4.0, 25.0)
    """SiTU-GLU's soft caps (beta1 on the gate half, beta2 on the up half)."""
    swiglu_clamp: tuple[float, float] = (1.702, 7.0)
    """The clamped SwiGLU's (alpha, limit): (up + 1) x gate sigmoid(alpha gate), the gate clamped above at limit and
    up to [-limit, limit]."""
    router_bias: bool = False
    """The router's logits have a learned bias (gpt-oss's `mlp.router.bias`)."""
    expert_bias: bool = False
    """Each routed expert's two projections have biases (gpt-oss's `gate_up_proj_bias`, `down_proj_bias`)."""
    n_group: int = 1
    """Equal groups of routed experts for group-limited routing (1: none)."""
    topk_group: int = 1
    """Groups a token picks its experts from: those whose two best selection values sum highest."""


def check_layer_types(layer_types: tuple[LayerType, ...] | None, num_hidden_layers: int) -> None:
    """A `layer_types` list must name one attention kind per block."""
    if layer_types is not None and len(layer_types) != num_hidden_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers {num_hidden_layers}")


class ArchBase(BaseModel):
    """The fields and derived properties every architecture family shares; a family overrides the properties
    (`qk_norm`, `moe`, `attention_window`, ...) that its computation changes."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)

    hidden_size: int = Field(gt=0)
    """Width of the residual stream."""

    intermediate_size: int = Field(gt=0)
    """Hidden width of the gated MLP (SwiGLU unless the family's `hidden_act` says otherwise)."""

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

    rope_scaling: RopeScaling | None = None
    """Scaled RoPE frequencies for a context longer than the pretraining one (`linear`, `llama3` or `yarn`, with
    transformers' fields); unset: plain RoPE. A `rope_parameters` table as transformers 5 writes it is accepted too:
    its `rope_theta` sets the base and the rest this field."""

    rms_norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon of every RMSNorm."""

    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the LM head."""

    attention_bias: bool = False
    """Give the q/k/v/o projections a bias."""

    @model_validator(mode="before")
    @classmethod
    def _split_rope_parameters(cls, data: Any) -> Any:
        """A `rope_parameters` table into the fields it stands for (`split_rope_parameters`)."""
        return split_rope_parameters(data, "partial_rotary_factor" in cls.model_fields)

    @model_validator(mode="after")
    def _check_heads(self) -> ArchBase:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads and not self.mla:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; set head_dim explicitly"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(
                f"the rotary part of a head ({self.rotary_dim} of head_dim {self.dim_per_head}) must be even and "
                f"non-empty"
            )
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

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates (all of them unless a family says otherwise)."""
        return self.dim_per_head

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias."""
        return self.attention_bias

    @property
    def mlp_act(self) -> MlpAct:
        """The activation of the dense MLP's gate half: silu (SwiGLU) unless a family has a `hidden_act` field."""
        return "silu"

    @property
    def moe(self) -> MoESpec | None:
        """The mixture-of-experts block of the MoE layers; None for a dense architecture."""
        return None

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder block `index` has the MoE block instead of the dense MLP."""
        return False

    def attention_window(self, index: int) -> int | None:
        """The sliding window of decoder block `index` (keys per query, itself included), None for full attention."""
        return None

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3's, `lmforge.model.mla`)."""
        return False

    @property
    def value_head_dim(self) -> int:
        """Width of one value head: the query/key width unless a family narrows it (MLA)."""
        return self.dim_per_head

    @property
    def attention_sinks(self) -> bool:
        """Whether every attention layer has a learned sink logit per query head (`self_attn.sinks`)."""
        return False

    @property
    def norm_after_scale(self) -> bool:
        """Whether RMSNorm multiplies by its weight before casting back to the input's dtype (gpt-oss) rather than
        after (Llama); the same in fp32."""
        return False
