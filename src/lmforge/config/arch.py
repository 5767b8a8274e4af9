"""Architecture configs: the `[model.arch]` section, one class per `model_type`.

Field names follow the Hugging Face config classes of the same family, so an architecture written here
maps one to one onto the `config.json` of the exported model. The shared fields are `ArchBase`'s
(`lmforge.config.arch_base`); GLM-4.5 with its research options lives in `lmforge.config.arch_glm`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from lmforge.config.arch_base import ArchBase, LayerType, MlpAct, MoESpec, check_layer_types
from lmforge.config.arch_deepseek import DeepseekV3Arch
from lmforge.config.arch_glm import Glm4MoeArch


class DenseArch(ArchBase):
    """A dense family whose HF config applies `hidden_act` to every MLP (Llama, Qwen3): the one place the MLP
    activation is a field. The MoE families have none: their experts' gated activations are fixed by the family
    (`MoESpec.expert_glu`) and transformers applies their `hidden_act` to the experts as well."""

    hidden_act: MlpAct = "silu"
    """Activation on the gate half of every MLP: `silu` gives SwiGLU, down(silu(gate(x)) x up(x)); `relu2` gives
    down(relu(gate(x))^2 x up(x)), ReLU squared as in Primer (So et al., "Primer: Searching for Efficient
    Transformers for Language Modeling", arXiv 2109.08668). Exported as config.json's `hidden_act`, which
    transformers' LlamaForCausalLM / Qwen3ForCausalLM compute alike."""

    @property
    def mlp_act(self) -> MlpAct:
        """hidden_act."""
        return self.hidden_act


class LlamaArch(DenseArch):
    """A Llama decoder (`LlamaForCausalLM`)."""

    model_type: Literal["llama"] = "llama"
    """Architecture family: a Llama decoder."""


class Qwen3Arch(DenseArch):
    """A Qwen3 decoder (`Qwen3ForCausalLM`): Llama plus per-head RMSNorm on queries and keys."""

    model_type: Literal["qwen3"] = "qwen3"
    """Architecture family: a Qwen3 decoder (Llama with QK-norm)."""

    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of every RMSNorm, the QK-norms included."""

    rope_theta: float = Field(default=1_000_000.0, gt=0)
    """Base of the rotary position embedding frequencies."""

    use_sliding_window: bool = False
    """Give the blocks that `layer_types` marks `sliding_attention` a sliding window of `sliding_window` keys
    (transformers' switch; off: every block attends to the whole document)."""

    sliding_window: int = Field(default=4096, gt=0)
    """Keys a query of a sliding-window block attends to: itself and the sliding_window - 1 tokens before it, within
    its document."""

    max_window_layers: int = Field(default=28, ge=0)
    """With use_sliding_window and no layer_types: the blocks from this index on have the sliding window
    (transformers' rule)."""

    layer_types: tuple[LayerType, ...] | None = None
    """Each block's attention, `full_attention` or `sliding_attention` (with use_sliding_window); unset: from
    max_window_layers."""

    @model_validator(mode="after")
    def _check_windows(self) -> Qwen3Arch:
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.layer_types is not None and "sliding_attention" in self.layer_types and not self.use_sliding_window:
            raise ValueError("layer_types marks sliding_attention blocks but use_sliding_window is false")
        return self

    @property
    def qk_norm(self) -> bool:
        """Qwen3 always normalizes queries and keys per head."""
        return True

    @property
    def block_attention(self) -> list[LayerType]:
        """Each block's attention: layer_types, else transformers' rule (sliding from max_window_layers on)."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding_attention" if self.use_sliding_window and i >= self.max_window_layers else "full_attention"
                for i in range(self.num_hidden_layers)]  # fmt: skip

    def attention_window(self, index: int) -> int | None:
        """sliding_window for a `sliding_attention` block, else None."""
        return self.sliding_window if self.block_attention[index] == "sliding_attention" else None


class Qwen3MoeArch(ArchBase):
    """A Qwen3-MoE decoder (`Qwen3MoeForCausalLM`): Qwen3 attention (QK-norm) and a softmax-routed MoE block in
    every layer, without shared experts."""

    model_type: Literal["qwen3_moe"] = "qwen3_moe"
    """Architecture family: a Qwen3 mixture-of-experts decoder."""

    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of every RMSNorm, the QK-norms included."""

    rope_theta: float = Field(default=1_000_000.0, gt=0)
    """Base of the rotary position embedding frequencies."""

    intermediate_size: int = Field(default=6144, gt=0)
    """Width of the dense MLP of `mlp_only_layers`. Unused by the supported all-MoE layout; kept because the HF
    config carries it (transformers' default)."""

    moe_intermediate_size: int = Field(gt=0)
    """Hidden width of one expert's SwiGLU."""

    num_experts: int = Field(ge=2)
    """Number of routed experts per MoE block."""

    num_experts_per_tok: int = Field(gt=0)
    """Experts each token is sent to (top-k of the softmax)."""

    norm_topk_prob: bool = False
    """Rescale the chosen experts' probabilities to sum to one (transformers' default: no)."""

    decoder_sparse_step: int = Field(default=1, ge=1)
    """Every this many blocks is an MoE block; only 1 (all of them) is supported."""

    mlp_only_layers: tuple[int, ...] = ()
    """Blocks with a dense MLP instead of the MoE block; only none is supported."""

    use_sliding_window: bool = False
    """Give every block a sliding window of `sliding_window` keys (transformers' Qwen3-MoE windows all of them)."""

    sliding_window: int = Field(default=4096, gt=0)
    """Keys a query attends to with use_sliding_window: itself and the sliding_window - 1 tokens before it, within
    its document."""

    @model_validator(mode="after")
    def _check_moe(self) -> Qwen3MoeArch:
        if self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ValueError(
                f"decoder_sparse_step {self.decoder_sparse_step} with mlp_only_layers {list(self.mlp_only_layers)} "
                "is not supported; lmforge's Qwen3-MoE has the MoE block in every layer (decoder_sparse_step = 1, "
                "mlp_only_layers = [])"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")
        return self

    @property
    def qk_norm(self) -> bool:
        """Qwen3-MoE always normalizes queries and keys per head."""
        return True

    @property
    def moe(self) -> MoESpec:
        """Softmax scores, no selection bias, no shared experts."""
        return MoESpec(
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            score_func="softmax",
            selection_bias=False,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=1.0,
            num_shared_experts=0,
        )

    def is_moe_layer(self, index: int) -> bool:
        """Every block."""
        return True

    def attention_window(self, index: int) -> int | None:
        """sliding_window in every block with use_sliding_window, else None."""
        return self.sliding_window if self.use_sliding_window else None


class GptOssArch(ArchBase):
    """A gpt-oss decoder (`GptOssForCausalLM`): attention with q/k/v/o biases and a learned sink logit per head,
    blocks alternating a sliding window and full attention, and in every block an MoE of clamped-SwiGLU experts with
    biases behind a softmax router with a bias; RMSNorm scales before casting back."""

    model_type: Literal["gpt_oss"] = "gpt_oss"
    """Architecture family: a gpt-oss mixture-of-experts decoder."""

    intermediate_size: int = Field(gt=0)
    """Hidden width of one routed expert's clamped SwiGLU (gpt-oss has no dense MLP and no shared expert)."""

    num_local_experts: int = Field(ge=2)
    """Number of routed experts per MoE block."""

    num_experts_per_tok: int = Field(default=4, gt=0)
    """Experts each token is sent to: the top k of the router's logits, whose gate values are the softmax over
    those k logits."""

    rope_theta: float = Field(default=150_000.0, gt=0)
    """Base of the rotary position embedding frequencies (gpt-oss's; its released models add YaRN scaling, set in
    `rope_scaling`)."""

    attention_bias: bool = True
    """Give the q/k/v/o projections a bias (gpt-oss has them)."""

    sliding_window: int = Field(default=128, gt=0)
    """Keys a query of a `sliding_attention` block attends to: itself and the sliding_window - 1 tokens before it,
    within its document."""

    layer_types: tuple[LayerType, ...] | None = None
    """Each block's attention, `sliding_attention` or `full_attention`; unset: transformers' alternation, sliding
    in the even blocks (0, 2, ...) and full in the odd ones."""

    swiglu_alpha: float = Field(default=1.702, gt=0)
    """Sigmoid gain of the experts' clamped SwiGLU: (up + 1) x gate x sigmoid(swiglu_alpha x gate)."""

    swiglu_limit: float = Field(default=7.0, gt=0)
    """Clamp of the experts' SwiGLU inputs: the gate half above at swiglu_limit, the up half to [-limit, limit]."""

    @model_validator(mode="after")
    def _check_moe(self) -> GptOssArch:
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_local_experts {self.num_local_experts}"
            )
        return self

    @property
    def block_attention(self) -> list[LayerType]:
        """Each block's attention: layer_types, else sliding in even blocks and full in odd ones."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]

    def attention_window(self, index: int) -> int | None:
        """sliding_window for a `sliding_attention` block, else None."""
        return self.sliding_window if self.block_attention[index] == "sliding_attention" else None

    @property
    def attention_sinks(self) -> bool:
        """Every gpt-oss attention layer has a sink logit per query head."""
        return True

    @property
    def norm_after_scale(self) -> bool:
        """gpt-oss's RMSNorm scales in fp32, then casts."""
        return True

    @property
    def moe(self) -> MoESpec:
        """Softmax over the top-k logits of a biased router, clamped-SwiGLU experts with biases, nothing shared."""
        return MoESpec(
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            score_func="softmax",
            selection_bias=False,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            num_shared_experts=0,
            expert_glu="clamped_swiglu",
            swiglu_clamp=(self.swiglu_alpha, self.swiglu_limit),
            router_bias=True,
            expert_bias=True,
        )

    def is_moe_layer(self, index: int) -> bool:
        """Every block."""
        return True


AnyArch = LlamaArch | Qwen3Arch | Glm4MoeArch | Qwen3MoeArch | GptOssArch | DeepseekV3Arch
"""The type of any architecture config."""

ArchConfig = Annotated[AnyArch, Field(discriminator="model_type")]
"""Any architecture, chosen by its `model_type` field."""
