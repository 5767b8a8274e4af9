"""The DeepSeek-V3 architecture config (`model_type = "deepseek_v3"`): multi-head latent attention (MLA) and
GLM-4.5's kind of MoE (sigmoid router with a selection bias, group-limited routing, shared experts, dense first
blocks)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from lmforge.config.arch_base import MoESpec
from lmforge.config.arch_moe import BiasedMoEArch


class DeepseekV3Arch(BiasedMoEArch):
    """A DeepSeek-V3 decoder (`DeepseekV3ForCausalLM`): MLA attention, whose queries (optionally through a low-rank
    `q_lora_rank`) and keys/values (through a shared `kv_lora_rank` latent) carry a no-position part and a RoPE
    part, the RoPE key shared by all heads; then a dense MLP in the first `first_k_dense_replace` blocks and an MoE
    block in the others."""

    model_type: Literal["deepseek_v3"] = "deepseek_v3"
    """Architecture family: a DeepSeek-V3 decoder."""

    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of every RMSNorm, MLA's latent norms included."""

    q_lora_rank: int | None = Field(default=None, gt=0)
    """Rank of the queries' low-rank path (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`); unset: one `q_proj`
    (DeepSeek-V3 itself uses 1536)."""

    kv_lora_rank: int = Field(gt=0)
    """Width of the compressed key/value latent (`kv_a_proj_with_mqa` -> `kv_a_layernorm` -> `kv_b_proj`)."""

    qk_nope_head_dim: int = Field(gt=0)
    """Channels of each query and key head without position information (from the latent)."""

    qk_rope_head_dim: int = Field(gt=0)
    """Channels of each query and key head that RoPE rotates; the key's are one head shared by all heads."""

    v_head_dim: int = Field(gt=0)
    """Width of one value head (and of each head's attention output)."""

    rope_interleave: bool = True
    """The RoPE channels are rotated in interleaved pairs (0, 1), (2, 3), ... (DeepSeek's layout) rather than as
    two halves."""

    num_nextn_predict_layers: int = Field(default=0, ge=0)
    """Multi-token-prediction modules D after the decoder (DeepSeek-V3: 1): module k predicts each position's token
    k + 1 ahead, trained with weight `model.mtp_weight`; checkpoints store them as decoder layers
    num_hidden_layers.. (docs/model.md#multi-token-prediction)."""

    @model_validator(mode="after")
    def _check_deepseek(self) -> DeepseekV3Arch:
        if self.num_key_value_heads is not None and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads {self.num_key_value_heads} must equal num_attention_heads "
                f"{self.num_attention_heads} (MLA expands its latent into one key and value per head)"
            )
        if self.head_dim is not None:
            raise ValueError("head_dim is not a DeepSeek-V3 field: set qk_nope_head_dim, qk_rope_head_dim, v_head_dim")
        return self

    @property
    def mla(self) -> bool:
        """Attention is MLA (`lmforge.model.mla`)."""
        return True

    @property
    def dim_per_head(self) -> int:
        """Width of one query/key head: its no-position and RoPE parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        """v_head_dim."""
        return self.v_head_dim

    @property
    def rotary_dim(self) -> int:
        """qk_rope_head_dim (the heads' trailing channels)."""
        return self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(query width), times YaRN's mscale(factor, mscale_all_dim)^2 when the scaling sets
        mscale_all_dim (DeepSeek's rule: every channel's logit scaled, not only the rotated ones)."""
        scale = self.dim_per_head**-0.5
        rope = self.rope_scaling
        if rope is not None and rope.rope_type == "yarn" and rope.mscale_all_dim and rope.factor > 1:
            mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def moe(self) -> MoESpec:
        """Sigmoid scores, selection bias, group-limited routing, shared experts."""
        return self.routing_spec()
