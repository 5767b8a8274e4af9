"""Parameter roles, which decide optimizer groups, weight decay and per-group metrics."""

from __future__ import annotations

from torch import nn

ROLES = ("hidden", "embed", "head", "norm", "bias")
"""hidden: 2-D matrices inside the blocks; embed: token embedding; head: LM head; norm: norm scales; bias: biases."""

DECAYED_ROLES = frozenset({"hidden", "embed", "head"})
"""Roles that take weight decay."""


def param_role(name: str, ndim: int) -> str:
    """The role of a parameter from its canonical (HF) name and rank."""
    if name.endswith(".bias"):
        return "bias"
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "head"
    if ndim >= 2:
        return "hidden"
    return "norm"


def params_by_role(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters grouped by role, in model order; tied parameters appear once."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(param_role(name, p.ndim), []).append((name, p))
    return {role: groups[role] for role in ROLES if role in groups}
