"""`Optimizers`: the run's optimizers over parameter-role groups with their gradient norms, clipping and
learning-rate schedule, so the step loop makes one call per optimizer step; `build_optimizer` makes it."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.config import ConfigError
from lmforge.config.optim import MuonConfig, OptimConfig, ScheduleConfig
from lmforge.model.completep import STANDARD, RoleScale
from lmforge.optim.clipping import clip_gradients, group_grad_squares
from lmforge.optim.groups import DECAYED_ROLES, MATRIX_ROLES, ROLES, params_by_role
from lmforge.optim.schedule import wsd_multiplier

EXPERT_ROLES = frozenset({"expert_hidden", "expert_out"})
"""The routed experts' 3-D stacks [E, A, B], which Muon orthogonalizes per expert unless `optim.muon_experts` is
false."""


@dataclass
class OptimizerStep:
    """What one `Optimizers.update` did."""

    grad_norm: float
    """Global gradient norm before clipping (NaN or inf when some gradient is not finite)."""
    group_norms: dict[str, float]
    """Gradient norm of each group (by role name), before clipping."""
    lr_multiplier: float
    """The schedule's multiplier of the peak learning rates at this step."""
    skipped: bool
    """True when the update was skipped: a non-finite gradient norm or no loss token in the step."""


class Optimizers:
    """The run's optimizers acting as one: Muon for the block matrices (and expert stacks) plus AdamW for the rest,
    or AdamW alone, with the learning-rate schedule and gradient clipping that drive them.

    `param_groups` lists every group of every optimizer (the dicts themselves, so changes apply); each group has
    a `name` (its role) and its peak learning rate in `base_lr`. The schedule runs from `schedule_start` (0, or the
    step a resumed run restarted its schedule at) to `max_steps`.
    """

    def __init__(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        schedule: ScheduleConfig | None = None,
        max_steps: int = 1,
        max_norm: float = 0.0,
    ) -> None:
        """`schedule` None holds the learning rates at their peak; `max_norm` 0 turns clipping off."""
        self.optimizers = tuple(optimizers)
        self.schedule = schedule
        self.max_steps = max_steps
        self.max_norm = max_norm
        self.schedule_start = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All groups, Muon's first."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Per-parameter optimizer state of every optimizer (each parameter belongs to one of them)."""
        return {p: st for opt in self.optimizers for p, st in opt.state.items()}

    def step(self) -> None:
        """One update of every group at the current learning rates (no clipping, no schedule)."""
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every gradient."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def grad_squares(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's per-group sums of squared gradient entries, on the device (see `group_grad_squares`)."""
        return group_grad_squares(self, device)

    def lr_multiplier(self, step: int) -> float:
        """The schedule's multiplier at optimizer step `step` (1-based)."""
        if self.schedule is None:
            return 1.0
        return wsd_multiplier(step - self.schedule_start, self.max_steps - self.schedule_start, self.schedule)

    def update(self, step: int, group_squares: Mapping[str, float], has_loss_tokens: bool = True) -> OptimizerStep:
        """Optimizer step `step` (1-based) from the global per-group squared gradient norms: clip, set the
        scheduled learning rates, update (unless the norm is not finite or the step had no loss token), and drop
        the gradients."""
        grad_norm = math.sqrt(sum(group_squares.values()))
        clip_gradients(self, grad_norm, self.max_norm)
        multiplier = self.lr_multiplier(step)
        set_lr_multiplier(self, multiplier)
        skipped = not math.isfinite(grad_norm) or not has_loss_tokens
        if not skipped:
            self.step()
        self.zero_grad(set_to_none=True)
        norms = {name: math.sqrt(sq) for name, sq in group_squares.items()}
        return OptimizerStep(grad_norm, norms, multiplier, skipped)

    def schedule_state(self) -> dict[str, int]:
        """What a checkpoint keeps of the schedule (the optimizers' own state goes through DCP)."""
        return {"schedule_start": self.schedule_start}

    def load_schedule_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `schedule_state` returned."""
        self.schedule_start = int(state["schedule_start"])


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
    scale: Callable[[str], RoleScale] = lambda role: STANDARD,
    schedule: ScheduleConfig | None = None,
    max_steps: int = 1,
) -> Optimizers:
    """Groups by parameter role, each with its learning rate, weight decay and eps times the role's `scale`
    (CompleteP; 1 otherwise), and its learning rate times the role's factor in `cfg.lr_multipliers`. Muon takes the
    matrix roles and, with `cfg.muon_experts`, the expert stacks (minus `adamw_params`, whose groups are named
    `<role>_adamw`), AdamW the rest. With `schedule`, `Optimizers.update` follows it over `max_steps`; clipping uses
    `cfg.max_norm`."""
    muon_groups, adamw_groups = _plan_groups(model, cfg, scale)
    adamw_lr = (cfg.adamw_lr or cfg.lr) if isinstance(cfg, MuonConfig) else cfg.lr
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
                orthogonalizer=cfg.orthogonalizer,
                normuon=cfg.normuon,
                normuon_beta2=cfg.normuon_beta2,
                cautious_weight_decay=cfg.cautious_weight_decay,
            )
        )
    if adamw_groups:
        # The fused kernel on the CPU too: on the CPU the foreach path loops over the tensors op by op (20 ms a step
        # for the 8.9M-parameter Llama of docs/benchmarks.md, against 6 ms fused).
        optimizers.append(
            torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
        )
    return Optimizers(optimizers, schedule, max_steps, cfg.max_norm)


def group_base_lrs(
    model: nn.Module, cfg: OptimConfig, scale: Callable[[str], RoleScale] = lambda role: STANDARD
) -> dict[str, float]:
    """The name and peak learning rate of every group `build_optimizer` makes for `model`, Muon's first (`model`
    may be on the meta device): under pipeline parallelism a rank holds some groups only, and the step's metrics
    name them all."""
    muon_groups, adamw_groups = _plan_groups(model, cfg, scale)
    return {g["name"]: g["base_lr"] for g in [*muon_groups, *adamw_groups]}


def _plan_groups(
    model: nn.Module, cfg: OptimConfig, scale: Callable[[str], RoleScale]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Muon's and AdamW's parameter groups of `model` (see `build_optimizer`)."""
    by_role = params_by_role(model)
    unknown = sorted(set(cfg.lr_multipliers) - set(ROLES))
    if unknown:
        raise ConfigError(f"optim.lr_multipliers: unknown role(s) {unknown}; the roles are {', '.join(ROLES)}")
    adamw_lr = (cfg.adamw_lr or cfg.lr) if isinstance(cfg, MuonConfig) else cfg.lr
    muon_groups: list[dict[str, Any]] = []
    adamw_groups: list[dict[str, Any]] = []
    for role, named in by_role.items():
        s = scale(role)
        factor = cfg.lr_multipliers.get(role, 1.0)
        decay = cfg.weight_decay if role in DECAYED_ROLES else 0.0
        if isinstance(cfg, MuonConfig) and (role in MATRIX_ROLES or (cfg.muon_experts and role in EXPERT_ROLES)):
            moved = [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in cfg.adamw_params)]
            kept = [(n, p) for n, p in named if (n, p) not in moved]
            if kept:
                # lr x weight decay stays constant per role, as for the AdamW groups.
                muon_groups.append(_group(role, kept, cfg.lr * s.muon_lr * factor, decay / s.muon_lr))
            named, role = moved, f"{role}_adamw"
        if named:
            adamw_groups.append(
                _group(role, named, adamw_lr * s.lr * factor, decay * s.weight_decay, eps=cfg.eps * s.eps)
            )
    return muon_groups, adamw_groups


def set_lr_multiplier(optimizer: Optimizers | torch.optim.Optimizer, multiplier: float) -> None:
    """Set every group's learning rate to its peak `base_lr` times `multiplier`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
