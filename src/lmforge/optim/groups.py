"""Parameters grouped by role (see `lmforge.model.roles`): the optimizer's groups and the per-group metrics."""

from __future__ import annotations

from torch import nn

from lmforge.model.roles import DECAYED_ROLES, MATRIX_ROLES, ROLES, param_role

__all__ = ["DECAYED_ROLES", "MATRIX_ROLES", "ROLES", "param_role", "params_by_role"]


def params_by_role(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters grouped by role, in model order; tied parameters appear once."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(param_role(name, p.ndim), []).append((name, p))
    return {role: groups[role] for role in ROLES if role in groups}
