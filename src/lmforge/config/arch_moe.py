"""The MoE of DeepSeek's kind that GLM-4.5 and DeepSeek-V3 share: a sigmoid router whose selection bias lmforge
balances, optional group-limited routing, a routed scaling factor, shared experts, and dense first blocks."""

from __future__ import annotations

from pydantic import Field, model_validator

from lmforge.config.arch_base import ArchBase, MoESpec


class BiasedMoEArch(ArchBase):
    """The fields and checks of that MoE; a family adds its attention and turns them into its `MoESpec`."""

    intermediate_size: int = Field(gt=0)
    """Hidden width of the dense SwiGLU MLP of the first `first_k_dense_replace` blocks."""

    moe_intermediate_size: int = Field(gt=0)
    """Hidden width of one routed (and one shared) expert's SwiGLU."""

    n_routed_experts: int = Field(ge=2)
    """Number of routed experts per MoE block."""

    num_experts_per_tok: int = Field(gt=0)
    """Routed experts each token is sent to (top-k)."""

    n_shared_experts: int = Field(default=1, ge=0)
    """Experts every token goes through, fused into one SwiGLU of n_shared_experts x moe_intermediate_size."""

    first_k_dense_replace: int = Field(default=1, ge=0)
    """The first this many blocks have a dense MLP (intermediate_size) instead of the MoE block (DeepSeek-V3: 3)."""

    norm_topk_prob: bool = True
    """Rescale the chosen experts' sigmoid scores to sum to one before routed_scaling_factor."""

    routed_scaling_factor: float = Field(default=1.0, gt=0)
    """Multiplier on the routed experts' gate values (DeepSeek-V3: 2.5)."""

    n_group: int = Field(default=1, ge=1)
    """Expert groups for group-limited routing (DeepSeek-V3's): the routed experts split into this many equal
    groups, each scored by the sum of its two highest selection values; 1: no groups."""

    topk_group: int = Field(default=1, ge=1)
    """Groups a token may pick its experts from: the topk_group best-scored groups."""

    @model_validator(mode="after")
    def _check_routing(self) -> BiasedMoEArch:
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
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts {self.n_routed_experts}"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace {self.first_k_dense_replace} exceeds num_hidden_layers {self.num_hidden_layers}"
            )
        return self

    def routing_spec(self, **options: object) -> MoESpec:
        """The MoE block: sigmoid scores, selection bias, shared experts, groups; `options` sets the other
        `MoESpec` fields (research options)."""
        return MoESpec(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            score_func="sigmoid",
            selection_bias=True,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            num_shared_experts=self.n_shared_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            **options,  # type: ignore[arg-type]
        )

    def is_moe_layer(self, index: int) -> bool:
        """Every block from first_k_dense_replace on."""
        return index >= self.first_k_dense_replace
