"""Parameter roles: what a parameter is in the model, from its canonical (HF) name and rank.

Roles decide the init scale, the optimizer group (and so learning rate, weight decay, eps) and the per-group
metrics.
"""

from __future__ import annotations

ROLES = ("hidden", "residual_out", "expert_hidden", "expert_out", "router", "embed", "head", "norm", "bias", "hyper")
"""hidden: 2-D matrices inside the blocks that read the residual stream (q/k/v, gate/up projections, shared experts'
gate/up, LatentMoE's latent_down_proj); residual_out: the matrices that write a block's branch back into the residual
stream (o_proj, down_proj, LatentMoE's latent_up_proj); expert_hidden / expert_out: the same two kinds for the routed
experts, stacked 3-D [E, out, in] (`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`); router: an MoE block's router
matrix (`mlp.gate.weight`); embed: token embedding; head: LM head; norm: norm scales; bias: biases (the routed experts'
stacked ones, `gate_up_proj_bias` / `down_proj_bias`, and a router's `mlp.gate.bias` too) and gpt-oss's attention sinks
(`self_attn.sinks`, one logit per head: additive, like a bias); hyper: every parameter of a hyper-connection
(`attn_hc.*`, `mlp_hc.*`: connection weights, their dynamic projections, scales and norm), trained by AdamW without
weight decay whatever the optimizer."""

MATRIX_ROLES = frozenset({"hidden", "residual_out"})
"""The 2-D matrices inside the blocks (Muon's share of the model). The routed experts' 3-D stacks join them per
expert unless `optim.muon_experts` is false (`lmforge.optim.EXPERT_ROLES`); the router stays with AdamW, as small,
precision-sensitive routers usually are."""

DECAYED_ROLES = frozenset({"hidden", "residual_out", "expert_hidden", "expert_out", "router", "embed", "head"})
"""Roles that take weight decay (every matrix)."""

RESIDUAL_OUT = ("o_proj", "down_proj", "latent_up_proj")
"""Modules whose output is added to the residual stream (matched by the module's own name, so LatentMoE's
`latent_down_proj`, which reads the stream, stays `hidden`)."""

HYPER_MODULES = ("attn_hc", "mlp_hc")
"""A decoder block's hyper-connection modules (`lmforge.model.hyper_connections`), whose parameters have role
`hyper`."""


def param_role(name: str, ndim: int) -> str:
    """The role of a parameter from its canonical name and number of dimensions."""
    if any(f".{module}." in f".{name}" for module in HYPER_MODULES):
        return "hyper"
    if name.endswith((".bias", "_bias", ".sinks")):
        return "bias"
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "head"
    if ".mlp.experts." in f".{name}":
        return "expert_out" if name.endswith("down_proj") else "expert_hidden"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if ndim >= 2:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        return "residual_out" if module in RESIDUAL_OUT else "hidden"
    return "norm"
