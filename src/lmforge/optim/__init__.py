"""Optimizers over parameter-role groups, and the learning-rate schedule."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config.optim import AdamWConfig, OptimConfig
from lmforge.optim.groups import DECAYED_ROLES, params_by_role
from lmforge.optim.schedule import wsd_multiplier

__all__ = ["build_optimizer", "set_lr_multiplier", "wsd_multiplier"]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """One optimizer with a group per parameter role (`group["name"]`); each group keeps its peak lr in `base_lr`."""
    if not isinstance(cfg, AdamWConfig):
        raise ValueError(f"unsupported optimizer {cfg.type!r}")
    groups = []
    for role, named in params_by_role(model).items():
        groups.append(
            {
                "name": role,
                "params": [p for _, p in named],
                "param_names": [n for n, _ in named],
                "lr": cfg.lr,
                "base_lr": cfg.lr,
                "weight_decay": cfg.weight_decay if role in DECAYED_ROLES else 0.0,
            }
        )
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kind)


def set_lr_multiplier(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Set every group's learning rate to its peak `base_lr` times `multiplier`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
