"""Architecture configs: the `[model.arch]` section, one class per `model_type`.

Field names follow the Hugging Face config classes of the same family, so an architecture written here
maps one to one onto the `config.json` of the exported model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmforge.config.rope import RopeScaling, split_rope_parameters

LayerType = Literal["full_attention", "sliding_attention"]
"""The attention of one decoder block, as transformers' `layer_types` name it."""


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
    expert_glu: Literal["swiglu", "situ_glu"] = "swiglu"
    """The routed experts' gated activation: silu(gate) x up, or Kimi K3's SiTU-GLU."""
    situ_betas: tuple[float, float] = (4.0, 25.0)
    """SiTU-GLU's soft caps (beta1 on the gate half, beta2 on the up half)."""
    n_group: int = 1
    """Equal groups of routed experts for group-limited routing (1: none)."""
    topk_group: int = 1
    """Groups a token picks its experts from: those whose two best selection values sum highest."""


class _ArchBase(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)

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
    def moe(self) -> MoESpec | None:
        """The mixture-of-experts block of the MoE layers; None for a dense architecture."""
        return None

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder block `index` has the MoE block instead of the dense MLP."""
        return False

    def attention_window(self, index: int) -> int | None:
        """The sliding window of decoder block `index` (keys per query, itself included), None for full attention."""
        return None


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
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for num_hidden_layers {self.num_hidden_layers}"
                )
            if "sliding_attention" in self.layer_types and not self.use_sliding_window:
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


class Glm4MoeArch(_ArchBase):
    """A GLM-4.5 MoE decoder (`Glm4MoeForCausalLM`): sigmoid router with a selection bias, shared experts, the first
    `first_k_dense_replace` blocks dense, RoPE on part of each head, optional QK-norm and q/k/v biases."""

    model_type: Literal["glm4_moe"] = "glm4_moe"
    """Architecture family: a GLM-4.5 mixture-of-experts decoder."""

    intermediate_size: int = Field(gt=0)
    """Hidden width of the dense SwiGLU MLP of the first `first_k_dense_replace` blocks."""

    attention_bias: bool = False
    """Give the q/k/v projections a bias (GLM-4.5's o_proj never has one)."""

    moe_intermediate_size: int = Field(gt=0)
    """Hidden width of one routed (and one shared) expert's SwiGLU."""

    n_routed_experts: int = Field(ge=2)
    """Number of routed experts per MoE block."""

    num_experts_per_tok: int = Field(gt=0)
    """Routed experts each token is sent to (top-k)."""

    n_shared_experts: int = Field(default=1, ge=0)
    """Experts every token goes through, fused into one SwiGLU of n_shared_experts x moe_intermediate_size."""

    first_k_dense_replace: int = Field(default=1, ge=0)
    """The first this many blocks have a dense MLP (intermediate_size) instead of the MoE block."""

    norm_topk_prob: bool = True
    """Rescale the chosen experts' sigmoid scores to sum to one before routed_scaling_factor."""

    routed_scaling_factor: float = Field(default=1.0, gt=0)
    """Multiplier on the routed experts' gate values."""

    n_group: int = Field(default=1, ge=1)
    """Expert groups for group-limited routing (DeepSeek-V3's): the routed experts split into this many equal
    groups, each scored by the sum of its two highest selection values; 1: no groups."""

    topk_group: int = Field(default=1, ge=1)
    """Groups a token may pick its experts from: the topk_group best-scored groups."""

    use_qk_norm: bool = False
    """RMS-normalize queries and keys per head before RoPE."""

    partial_rotary_factor: float = Field(default=0.5, gt=0, le=1)
    """Share of each head's channels (the leading ones) that RoPE rotates; transformers' default is 0.5."""

    load_balance_coeff: float | None = Field(default=None, gt=0)
    """Step size of the auxiliary-loss-free balancing: once per step each MoE block's selection bias moves by this
    much towards its under-loaded experts (DeepSeek-V3's sign rule). Unset: the bias is never updated."""

    attn_output_gate: Literal["none", "headwise", "elementwise"] = "none"
    """Research option (off: GLM-4.5): gated attention (Qiu et al., "Gated Attention for Large Language Models",
    2025). The attention output of each head is multiplied by sigmoid(g_proj(x)) before `o_proj`, x being the
    block's normed input: one gate per head (`headwise`, g_proj [heads, hidden]) or per channel (`elementwise`,
    g_proj [heads x head_dim, hidden]). Exports with model_type `lmforge_moe`."""

    xsa: bool = False
    """Research option (off: GLM-4.5): exclusive self attention (Zhai, arXiv 2603.09078). Each head's output y_i
    keeps only its component orthogonal to the token's own value vector v_i: y_i - (y_i . v_i) v_i / |v_i|^2. No
    parameters; every attention backend and document masking. Exports with model_type `lmforge_moe`."""

    null_experts: int = Field(default=0, ge=0)
    """Research option (0: GLM-4.5): zero-computation experts the router may choose among its top k, so a token
    uses between 0 and k real experts (AdaMoE, Zeng et al. 2024; MoE++, Jin et al. 2024). The router scores
    n_routed_experts + null_experts experts; a null choice's gate value is part of the top-k normalization and its
    output is zero. The selection bias balances null experts like real ones, so about k x n_routed_experts /
    (n_routed_experts + null_experts) real experts per token on average. Exports with model_type `lmforge_moe`."""

    router_bias_on_logits: bool = False
    """Research option (off: GLM-4.5): experts are chosen by the router's logits + `e_score_correction_bias`
    instead of its sigmoid scores + bias (the gate values still come from the unbiased scores). A bias on logits
    acts as a multiplicative shift of the odds, the same at every score level. Exports with model_type
    `lmforge_moe`."""

    moe_latent_size: int = Field(default=0, ge=0)
    """Research option (0: GLM-4.5): LatentMoE (Elango et al., "LatentMoE: Toward Optimal Accuracy per FLOP and
    Parameter in Mixture of Experts", arXiv 2601.18089; NVIDIA Nemotron 3 Super). The routed experts work in this
    smaller width: each MoE block projects a token once by `mlp.latent_down_proj` [latent, hidden], its routed
    experts are SwiGLUs from and to the latent width (stacks [E, 2I, latent] and [E, latent, I]), and the gated sum
    of their outputs goes back by `mlp.latent_up_proj` [hidden, latent]; the router and the shared experts read the
    full hidden state. Expert weights and expert-parallel all-to-all bytes shrink by hidden / latent. Must be below
    hidden_size. Exports with model_type `lmforge_moe`."""

    expert_glu: Literal["swiglu", "situ_glu"] = "swiglu"
    """Research option (swiglu: GLM-4.5): the routed experts' gated activation. `situ_glu` is Kimi K3's SiTU-GLU,
    beta1 tanh(g / beta1) sigmoid(g) x beta2 tanh(u / beta2) for the gate and up halves g, u (a SwiGLU whose two
    factors are soft-capped, so |output| <= beta1 x beta2); the shared experts and dense MLPs stay SwiGLU. Exports
    with model_type `lmforge_moe`."""

    situ_beta: float = Field(default=4.0, gt=0)
    """SiTU-GLU's soft cap on the gate half (beta1; used with `expert_glu = "situ_glu"`)."""

    situ_linear_beta: float = Field(default=25.0, gt=0)
    """SiTU-GLU's soft cap on the up half (beta2; used with `expert_glu = "situ_glu"`)."""

    hyper_connections: int = Field(default=0, ge=0)
    """Research option (0: GLM-4.5): hyper-connections (Zhu et al., "Hyper-Connections", arXiv 2409.19606) with
    this expansion rate n. The residual stream is widened to n copies (the embedding output copied n times, the
    copies summed before the final norm); each sub-layer (attention and the MLP, `self_attn` and `mlp` of every
    block) reads a weighted sum of the copies (A_m [n]) and writes its output into each copy (weights B [n]) on
    top of a mix of the copies (A_r [n, n]), under `model.layers.{i}.attn_hc.*` / `mlp_hc.*`. The paper's init
    makes the network equal the plain one at init. 1 is allowed (one stream with learned scalar connections, the
    paper's n = 1 case). Exports with model_type `lmforge_moe`."""

    hyper_connections_dynamic: bool = True
    """With `hyper_connections`: dynamic hyper-connections (DHC, the paper's default), whose weights A_m, A_r and B
    also depend on each token's normed copies through tanh projections scaled by learned factors (starting at
    0.01, the projections at 0, so DHC equals static HC at init); false: static hyper-connections (SHC)."""

    @model_validator(mode="after")
    def _check_moe(self) -> Glm4MoeArch:
        if self.moe_latent_size >= self.hidden_size:
            raise ValueError(
                f"moe_latent_size {self.moe_latent_size} must be below hidden_size {self.hidden_size} (0: no latent)"
            )
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                f"n_routed_experts {self.n_routed_experts} must split into n_group {self.n_group} equal groups of at "
                "least 2 experts (a group scores by its two best)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} exceeds n_group {self.n_group}")
        if self.n_group > 1 and self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of topk_group {self.topk_group} "
                f"groups ({self.topk_group * (self.n_routed_experts // self.n_group)})"
            )
        if self.n_group > 1 and (self.null_experts or self.router_bias_on_logits):
            raise ValueError("group-limited routing (n_group > 1) takes neither null_experts nor "
                             "router_bias_on_logits")  # fmt: skip
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts {self.n_routed_experts}"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace {self.first_k_dense_replace} exceeds num_hidden_layers {self.num_hidden_layers}"
            )
        return self

    @property
    def qk_norm(self) -> bool:
        """QK-norm is a switch in GLM-4.5."""
        return self.use_qk_norm

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates int(head_dim x partial_rotary_factor) leading channels, as transformers computes it."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def o_proj_bias(self) -> bool:
        """GLM-4.5's attention output projection has no bias, whatever attention_bias says."""
        return False

    @property
    def moe(self) -> MoESpec:
        """Sigmoid scores, selection bias, shared experts."""
        return MoESpec(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            score_func="sigmoid",
            selection_bias=True,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            num_shared_experts=self.n_shared_experts,
            null_experts=self.null_experts,
            bias_on_logits=self.router_bias_on_logits,
            latent_size=self.moe_latent_size,
            expert_glu=self.expert_glu,
            situ_betas=(self.situ_beta, self.situ_linear_beta),
            n_group=self.n_group,
            topk_group=self.topk_group,
        )

    @property
    def research_options(self) -> list[str]:
        """The research options this architecture turns on (empty: plain GLM-4.5, which transformers loads)."""
        on = {"attn_output_gate": self.attn_output_gate != "none", "xsa": self.xsa, "null_experts": self.null_experts,
              "router_bias_on_logits": self.router_bias_on_logits, "moe_latent_size": self.moe_latent_size,
              "expert_glu": self.expert_glu != "swiglu", "hyper_connections": self.hyper_connections}  # fmt: skip
        return [name for name, value in on.items() if value]

    def is_moe_layer(self, index: int) -> bool:
        """Every block from first_k_dense_replace on."""
        return index >= self.first_k_dense_replace


class Qwen3MoeArch(_ArchBase):
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


AnyArch = LlamaArch | Qwen3Arch | Glm4MoeArch | Qwen3MoeArch
"""The type of any architecture config."""

ArchConfig = Annotated[AnyArch, Field(discriminator="model_type")]
"""Any architecture, chosen by its `model_type` field."""
