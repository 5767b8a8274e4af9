"""CompleteP (Dey et al. 2025, alpha = 1): per-role factors on init, learning rate, weight decay and Adam eps.

Relative to a base shape (hidden size N0, depth L0) at which hyperparameters were tuned, a model of width N and
depth L has the width multiplier m_N = N / N0 and the depth multiplier m_L = L / L0. CompleteP multiplies each
residual branch by 1 / m_L and the logits by 1 / m_N. lmforge folds those two multipliers into the weights that
produce them (o_proj and down_proj; the LM head), so the model stays a plain Llama that exports unchanged.

Folding a constant multiplier c into a weight W (storing W' = c W) trains the same function under Adam when the
init std and learning rate are multiplied by c, the eps divided by c and the weight decay divided by c (the
gradient of W' is that of W divided by c, and Adam's update is invariant to gradient scale except through eps).
The factors below include those folds; docs/model.md has the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lmforge.config.arch import AnyArch


@dataclass(frozen=True)
class RoleScale:
    """Multipliers on the base init std, learning rate, weight decay and Adam eps of one parameter role."""

    init_std: float = 1.0
    """Multiplier on `model.init.std`."""
    lr: float = 1.0
    """Multiplier on the AdamW learning rate."""
    muon_lr: float = 1.0
    """Multiplier on the Muon learning rate (matrix roles under Muon)."""
    weight_decay: float = 1.0
    """Multiplier on the weight decay."""
    eps: float = 1.0
    """Multiplier on Adam's eps."""


STANDARD = RoleScale()
"""Every factor 1: the standard parameterization."""


def multipliers(arch: AnyArch, base_hidden_size: int, base_num_layers: int) -> tuple[float, float]:
    """(m_N, m_L): width and depth multipliers of `arch` relative to the base shape."""
    return arch.hidden_size / base_hidden_size, arch.num_hidden_layers / base_num_layers


def completep_scale(role: str, m_n: float, m_l: float) -> RoleScale:
    """The CompleteP factors of a parameter role, with the residual (1 / m_L) and logit (1 / m_N) multipliers
    folded into `residual_out` and `head`. Routed experts scale like the dense matrices they replace
    (`expert_hidden` like `hidden`, `expert_out` like `residual_out`); the router, which reads the residual stream
    like any hidden matrix, scales like `hidden`. Hyper-connection parameters (O(1) connection weights and their
    small dynamic terms) scale like the norm scales."""
    if role in ("expert_hidden", "router"):
        role = "hidden"
    elif role == "expert_out":
        role = "residual_out"
    if role == "hidden":
        return RoleScale(1 / math.sqrt(m_n), 1 / m_n, 1 / math.sqrt(m_n), m_n, 1 / (m_n * m_l))
    if role == "residual_out":
        c = 1 / m_l  # the residual-branch multiplier
        return RoleScale(c / math.sqrt(m_n), c / m_n, c / math.sqrt(m_n), m_n / c, 1 / (m_n * m_l) / c)
    if role == "head":
        c = 1 / m_n  # the logit multiplier
        return RoleScale(c, c, c, 1 / c, 1 / c)
    if role in ("norm", "bias", "hyper"):
        return RoleScale(eps=1 / m_l)
    if role == "embed":
        return STANDARD
    raise ValueError(f"no CompleteP rule for parameter role {role!r}")


def role_scales(
    arch: AnyArch, scheme: str, base_hidden_size: int | None, base_num_layers: int | None
) -> Callable[[str], RoleScale]:
    """role -> its factors under `scheme` (`normal`: all 1; `completep`: relative to the base shape)."""
    if scheme == "normal":
        return lambda role: STANDARD
    if scheme != "completep" or base_hidden_size is None or base_num_layers is None:
        raise ValueError(f"init scheme {scheme!r} needs base_hidden_size and base_num_layers")
    m_n, m_l = multipliers(arch, base_hidden_size, base_num_layers)
    return lambda role: completep_scale(role, m_n, m_l)
