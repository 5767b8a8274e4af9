"""Optimizers over parameter-role groups, gradient norms and clipping, and the learning-rate schedule."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lmforge.config.optim import MuonConfig, OptimConfig
from lmforge.model.completep import STANDARD, RoleScale
from lmforge.optim.groups import DECAYED_ROLES, MATRIX_ROLES, params_by_role
from lmforge.optim.schedule import wsd_multiplier

__all__ = ["Optimizers", "build_optimizer", "set_lr_multiplier", "wsd_multiplier"]


class Optimizers:
    """The run's optimizers acting as one: Muon for the block matrices plus AdamW for the rest, or AdamW alone.

    `param_groups` lists every group of every optimizer (the dicts themselves, so changes apply); each group has
    a `name` (its role) and its peak learning rate in `base_lr`.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = tuple(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All groups, Muon's first."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Per-parameter optimizer state of every optimizer (each parameter belongs to one of them)."""
        return {p: st for opt in self.optimizers for p, st in opt.state.items()}

    def step(self) -> None:
        """One update of every group."""
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every gradient."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _group(name: str, named: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float, **extra: Any) -> dict:
    return {
        "name": name,
        "params": [p for _, p in named],
        "param_names": [n for n, _ in named],
        "lr": lr,
        "base_lr": lr,
        "weight_decay": weight_decay,
        **extra,
    }


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device: torch.device,
    scale: Callable[[str], RoleScale] = lambda role: STANDARD,
) -> Optimizers:
    """Groups by parameter role, each with its learning rate, weight decay and eps times the role's `scale`
    (CompleteP; 1 otherwise). Muon takes the matrix roles (minus `adamw_params`), AdamW the rest."""
    by_role = params_by_role(model)
    adamw_lr = (cfg.adamw_lr or cfg.lr) if isinstance(cfg, MuonConfig) else cfg.lr
    muon_groups: list[dict[str, Any]] = []
    adamw_groups: list[dict[str, Any]] = []
    for role, named in by_role.items():
        s = scale(role)
        decay = cfg.weight_decay if role in DECAYED_ROLES else 0.0
        if isinstance(cfg, MuonConfig) and role in MATRIX_ROLES:
            moved = [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in cfg.adamw_params)]
            kept = [(n, p) for n, p in named if (n, p) not in moved]
            if kept:
                # lr x weight decay stays constant per role, as for the AdamW groups.
                muon_groups.append(_group(role, kept, cfg.lr * s.muon_lr, decay / s.muon_lr))
            named, role = moved, f"{role}_adamw"
        if named:
            adamw_groups.append(_group(role, named, adamw_lr * s.lr, decay * s.weight_decay, eps=cfg.eps * s.eps))
    optimizers: list[torch.optim.Optimizer] = []
    if muon_groups:
        from lmforge.optim.muon import Muon

        assert isinstance(cfg, MuonConfig)
        optimizers.append(
            Muon(
                muon_groups,
                lr=cfg.lr,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                ns_steps=cfg.ns_steps,
                ns_coefficients=cfg.ns_coefficients,
                adjust_lr=cfg.adjust_lr,
            )
        )
    if adamw_groups:
        kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
        optimizers.append(
            torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kind)
        )
    return Optimizers(optimizers)


def set_lr_multiplier(optimizer: Optimizers | torch.optim.Optimizer, multiplier: float) -> None:
    """Set every group's learning rate to its peak `base_lr` times `multiplier`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of a parameter's gradient (the local shard of a DTensor)."""
    g = p.grad
    if g is None:
        return None
    return g.to_local() if hasattr(g, "to_local") else g


def group_grad_squares(optimizer: Optimizers | torch.optim.Optimizer, device: torch.device) -> dict[str, torch.Tensor]:
    """Per group, the sum of squares of this rank's gradient entries (fp32, on the device, no host sync); summed
    over ranks they give each group's squared gradient norm."""
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        grads = [g for g in (local_grad(p) for p in group["params"]) if g is not None and g.numel()]
        total = torch.zeros((), device=device, dtype=torch.float32)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            total = torch.stack([n.float() for n in norms]).square().sum()
        out[group["name"]] = total
    return out


@torch.no_grad()
def clip_gradients(optimizer: Optimizers | torch.optim.Optimizer, total_norm: float, max_norm: float) -> None:
    """Scale every gradient by max_norm / total_norm when the norm exceeds max_norm (0: no clipping)."""
    if not max_norm or total_norm <= max_norm:
        return
    grads = [g for group in optimizer.param_groups for g in (local_grad(p) for p in group["params"]) if g is not None]
    torch._foreach_mul_(grads, max_norm / (total_norm + 1e-6))
