"""`[optim]` and `[schedule]`: the optimizer and the learning-rate multiplier over the run."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from lmforge.config.base import Section


class _OptimFields(Section):
    """Fields every optimizer has (AdamW's settings apply to Muon's AdamW groups too)."""

    lr: float = Field(gt=0)
    """Peak learning rate (the schedule multiplies it)."""

    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay of weight matrices and embeddings; norms and biases are never decayed."""

    beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW's first-moment decay (of the AdamW groups under Muon)."""

    beta2: float = Field(default=0.95, ge=0, lt=1)
    """AdamW's second-moment decay (of the AdamW groups under Muon)."""

    eps: float = Field(default=1e-8, gt=0)
    """AdamW's denominator epsilon."""

    max_norm: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 turns clipping off (the norm is still logged)."""

    lr_multipliers: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """Per-role factors on the peak learning rate, by the role names of `optim/lr/<role>` (`embed`, `head`, `norm`,
    `hidden`, `residual_out`, `expert_hidden`, `expert_out`, `router`, `bias`, `hyper`), e.g. `{ embed = 4.0, head =
    0.5 }` to tune an untied embedding and LM head on their own; on top of CompleteP's factors. Weight decay stays
    decoupled (`lr x weight_decay` per step), so it scales with the factor too. Empty: 1 everywhere."""


class AdamWConfig(_OptimFields):
    """`optim.type = "adamw"`: decoupled weight decay Adam (PyTorch's fused kernel) for every parameter."""

    type: Literal["adamw"] = "adamw"
    """Optimizer: AdamW."""


class MuonConfig(_OptimFields):
    """`optim.type = "muon"`: Muon for the 2-D matrices inside the blocks and (per expert) the MoE routed experts,
    AdamW for everything else (embeddings, LM head, norms, biases, routers, and any parameter `adamw_params` names);
    see docs/training.md#optimizers."""

    type: Literal["muon"] = "muon"
    """Optimizer: Muon with AdamW groups."""

    adamw_lr: float | None = Field(default=None, gt=0)
    """Peak learning rate of the AdamW groups; unset: `lr` (right with adjust_lr = "match_adamw_rms")."""

    momentum: float = Field(default=0.95, ge=0, lt=1)
    """Muon's momentum."""

    nesterov: bool = True
    """Nesterov momentum: orthogonalize grad + momentum x buffer instead of the buffer."""

    ns_steps: int = Field(default=5, ge=1)
    """Iterations of the orthogonalization (Newton–Schulz or Polar Express)."""

    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """Coefficients (a, b, c) of the quintic Newton–Schulz iteration (unused with orthogonalizer =
    "polar_express")."""

    orthogonalizer: Literal["newton_schulz", "polar_express"] = "newton_schulz"
    """How Muon orthogonalizes: `newton_schulz` repeats the quintic `ns_coefficients`; `polar_express` (Amsel et
    al. 2025, arXiv:2505.16932) takes a different minimax-optimal quintic at each iteration (the published ones, the
    last repeated beyond 8 steps) on the input divided by 1.01 x its Frobenius norm, and ends much closer to
    orthogonal in the same `ns_steps`."""

    normuon: bool = False
    """NorMuon (Li et al. 2025, arXiv:2510.05491): keep a second-moment average of each output row of the
    orthogonalized update, divide each row by its root, and rescale the update to its former Frobenius norm. Adds
    optimizer state of one value per row of each Muon matrix (per expert row for expert stacks)."""

    normuon_beta2: float = Field(default=0.95, ge=0, lt=1)
    """NorMuon's decay of the per-row second-moment average (used with normuon = true)."""

    cautious_weight_decay: bool = False
    """Cautious weight decay (Chen et al. 2025, arXiv:2510.12402) for the Muon matrices: decay only the entries
    where the update and the weight have the same sign. The AdamW groups keep plain decoupled decay."""

    adjust_lr: Literal["spectral", "match_adamw_rms"] = "match_adamw_rms"
    """Per-shape learning-rate factor of an (A, B) matrix: `spectral` = sqrt(max(1, A / B)); `match_adamw_rms` =
    0.2 sqrt(max(A, B)), which gives updates of AdamW's typical RMS so the AdamW learning rate carries over."""

    muon_experts: bool = True
    """Muon trains the MoE routed experts' 3-D weight stacks (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`),
    orthogonalizing each expert's matrix on its own; false: AdamW trains them."""

    adamw_params: list[str] = Field(default_factory=list)
    """Glob patterns of parameter names (e.g. `*.self_attn.q_proj.weight`) that AdamW trains instead of Muon."""


def _optim_tag(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "muon")
    return getattr(value, "type", "muon")


OptimConfig = Annotated[
    Annotated[AdamWConfig, Tag("adamw")] | Annotated[MuonConfig, Tag("muon")], Discriminator(_optim_tag)
]
"""Any optimizer, chosen by its `type` field (default: muon, or adamw when training starts from `model.name`)."""


class ScheduleConfig(Section):
    """`[schedule]`: warmup-stable-decay (WSD), one multiplier on every parameter group's learning rate."""

    warmup: float = Field(default=0.05, ge=0, le=1)
    """Fraction of max_steps over which the multiplier rises linearly from 0 to 1."""

    decay: float = Field(default=0.2, ge=0, le=1)
    """Fraction of max_steps, at the end of the run, over which the multiplier falls to end_ratio."""

    end_ratio: float = Field(default=0.0, ge=0, le=1)
    """Multiplier at the last step."""

    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay: linear, half cosine, or 1 - sqrt."""

    @model_validator(mode="after")
    def _fractions_fit(self) -> ScheduleConfig:
        if self.warmup + self.decay > 1:
            raise ValueError(f"warmup ({self.warmup}) + decay ({self.decay}) must not exceed 1")
        return self
