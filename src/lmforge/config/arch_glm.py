"""The GLM-4.5 MoE architecture config (`model_type = "glm4_moe"`) with lmforge's research options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmforge.config.arch_base import MoESpec
from lmforge.config.arch_moe import BiasedMoEArch


class Glm4MoeArch(BiasedMoEArch):
    """A GLM-4.5 MoE decoder (`Glm4MoeForCausalLM`): sigmoid router with a selection bias, shared experts, the first
    `first_k_dense_replace` blocks dense, RoPE on part of each head, optional QK-norm and q/k/v biases."""

    model_type: Literal["glm4_moe"] = "glm4_moe"
    """Architecture family: a GLM-4.5 mixture-of-experts decoder."""

    attention_bias: bool = False
    """Give the q/k/v projections a bias (GLM-4.5's o_proj never has one)."""

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
        if self.n_group > 1 and (self.null_experts or self.router_bias_on_logits):
            raise ValueError("group-limited routing (n_group > 1) takes neither null_experts nor "
                             "router_bias_on_logits")  # fmt: skip
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
        """Sigmoid scores, selection bias, shared experts, and the research options."""
        return self.routing_spec(
            null_experts=self.null_experts,
            bias_on_logits=self.router_bias_on_logits,
            latent_size=self.moe_latent_size,
            expert_glu=self.expert_glu,
            situ_betas=(self.situ_beta, self.situ_linear_beta),
        )

    @property
    def research_options(self) -> list[str]:
        """The research options this architecture turns on (empty: plain GLM-4.5, which transformers loads)."""
        on = {"attn_output_gate": self.attn_output_gate != "none", "xsa": self.xsa, "null_experts": self.null_experts,
              "router_bias_on_logits": self.router_bias_on_logits, "moe_latent_size": self.moe_latent_size,
              "expert_glu": self.expert_glu != "swiglu", "hyper_connections": self.hyper_connections}  # fmt: skip
        return [name for name, value in on.items() if value]
