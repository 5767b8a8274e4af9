"""Muon: momentum orthogonalized by Newton–Schulz, for 2-D matrices and 3-D stacks of them (MoE expert weights
[E, A, B], orthogonalized per expert), held whole or sharded by FSDP2.

The update follows `torch.optim.Muon` (same momentum, Nesterov, normalization and learning-rate scaling), so a
single-process step equals torch's up to float rounding; a stack's step equals one torch Muon per expert. What this
module adds is FSDP2 awareness: Newton–Schulz is not elementwise, so running it on a rank's row shard gives a
different (wrong) update. Instead each matrix is orthogonalized once, whole, by one owner rank, and every rank gets
its rows of the result back. Expert stacks are split along experts, so each rank orthogonalizes its own whole
experts where they are (see `Muon`). Optional variants (Polar Express, NorMuon, cautious weight decay) are
described there; their math lives in `lmforge.optim.polar` and `lmforge.optim.normuon`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lmforge.optim.muon_sharded import (
    gather_tensor_parallel,
    local,
    row_table,
    shard_group,
    step_sharded,
    tensor_split,
)
from lmforge.optim.normuon import normalize_rows
from lmforge.optim.polar import DEFAULT_NS_COEFFICIENTS, newton_schulz, polar_express

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate
else:  # a torch built without distributed support can still use the local path
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["ADJUST_LR", "DEFAULT_NS_COEFFICIENTS", "ORTHOGONALIZERS", "Muon", "newton_schulz"]

ParamsArg = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]

ORTHOGONALIZERS = ("newton_schulz", "polar_express")
"""Names of the orthogonalizations a group's `orthogonalizer` may take (see `lmforge.optim.polar`)."""

ROW_MOMENT = "row_second_moment"
"""NorMuon's per-row state key: a tensor [..., A, 1] beside each parameter [..., A, B], sharded like its rows."""


def _spectral_scale(rows: int, cols: int) -> float:
    # torch's "original": tall matrices get a larger step so the update's spectral norm per input unit matches
    return math.sqrt(max(1.0, rows / cols))


def _match_adamw_rms_scale(rows: int, cols: int) -> float:
    # torch's "match_rms_adamw" (Moonshot): gives the update about AdamW's RMS, so AdamW's lr and decay carry over
    return 0.2 * math.sqrt(max(rows, cols))


ADJUST_LR: dict[str, Callable[[int, int], float]] = {
    "spectral": _spectral_scale,
    "match_adamw_rms": _match_adamw_rms_scale,
}
"""Learning-rate multipliers by `adjust_lr` name, as functions of the matrix shape (rows, cols)."""


def _same(rows: Tensor) -> Tensor:
    return rows


@dataclass
class MatrixWork:
    """One parameter's work in a step: its update direction `u` (this rank's rows, each whole) before
    orthogonalization, with NorMuon its rows' second moments `v`, and how this rank's part of the parameter (and of
    its row state) is taken from those rows of the result."""

    param: Tensor
    group: dict[str, Any]
    u: Tensor
    v: Tensor | None = None
    """NorMuon's second moments [rows, 1] of `u`'s rows, in the same order; None without NorMuon."""
    v_state: Tensor | None = None
    """This rank's part of the parameter's row state, which the step overwrites."""
    take: Callable[[Tensor], Tensor] = _same
    """From this rank's rows of the orthogonalized matrix, its part of the parameter (under tensor parallelism
    the rows hold every TP rank's part; see `muon_sharded.gather_tensor_parallel`)."""
    take_v: Callable[[Tensor], Tensor] = _same
    """From the new second moments of those rows, this rank's part of the row state."""

    def direction(self, full_u: Tensor, full_v: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The update direction of whole rows (a whole matrix, or whole experts) of `u` with their second moments
        `full_v`: orthogonalized with the group's settings, then with NorMuon normalized per row; and the rows' new
        second moments (None without NorMuon)."""
        g = self.group
        # positional arguments: tests wrap these functions to count the matrices orthogonalized
        if g["orthogonalizer"] == "polar_express":
            ortho = polar_express(full_u, g["ns_steps"], g["eps"])
        else:
            ortho = newton_schulz(full_u, g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"])
        if full_v is None:
            return ortho, None
        return normalize_rows(ortho, full_v, g["normuon_beta2"], g["normuon_eps"])

    def apply(self, ortho_rows: Tensor, v_rows: Tensor | None) -> None:
        """Step this rank's part of the parameter with its rows of the update direction (and store its part of the
        rows' new second moments)."""
        if v_rows is not None:
            assert self.v_state is not None
            self.v_state.copy_(self.take_v(v_rows))
        _apply_update(self, self.take(ortho_rows))


class Muon(torch.optim.Optimizer):
    """Muon for 2-D matrices and 3-D expert stacks (plain tensors or FSDP2 DTensors sharded `Shard(0)`), matching
    `torch.optim.Muon` (per expert for a stack).

    Per parameter with a gradient `g`, with momentum `m` and learning rate `lr`:

    - `buf <- m * buf + (1 - m) * g` (state `momentum_buffer`, a tensor like the parameter: for FSDP2 a DTensor
      holding this rank's rows). This is torch's form; it is `(1 - m)` times the undamped `m * buf + g`, a factor the
      normalization inside Newton–Schulz removes, so both give the same update.
    - `u <- (1 - m) * g + m * buf` with Nesterov (again torch's form, `(1 - m)` times `g + m * buf_undamped`), else
      `u <- buf`.
    - `O <- newton_schulz(u)` on the whole matrix; `p <- p * (1 - lr * weight_decay)` (decoupled decay, unscaled lr);
      `p <- p - lr * scale(A, B) * O` with `scale` from `ADJUST_LR` for the parameter's full shape (A, B):
      `"spectral"` is `sqrt(max(1, A / B))` (torch's `"original"`), `"match_adamw_rms"` is `0.2 * sqrt(max(A, B))`
      (torch's `"match_rms_adamw"`).

    Expert stacks: a 3-D parameter [E, A, B] is E independent [A, B] matrices. The momentum is elementwise as above;
    each expert's [A, B] slice of `u` is orthogonalized exactly once, on its own (its own Frobenius norm, transposed
    when tall), all E in one batched Newton–Schulz; `scale(A, B)` and the decay are as for one [A, B] matrix. The
    step equals E separate `torch.optim.Muon` instances, one per expert.

    Variants, all off by default (and then the step is exactly the one above):

    - `orthogonalizer="polar_express"`: Polar Express (arXiv:2505.16932) instead of the fixed quintic: a different
      minimax-optimal quintic per iteration and the input divided by 1.01 times its Frobenius norm
      (`lmforge.optim.polar.polar_express`); `ns_steps` iterations, `ns_coefficients` unused.
    - `normuon=True`: NorMuon (arXiv:2510.05491). After orthogonalizing, each row r of O (an output neuron of the
      [A, B] matrix; of each expert's matrix for a stack) keeps `v_r <- normuon_beta2 * v_r + (1 - normuon_beta2) *
      mean_j O_rj^2` (state `row_second_moment`, [..., A, 1], no bias correction), O's rows are divided by
      `sqrt(v_r) + normuon_eps` and the result is rescaled to O's Frobenius norm (`lmforge.optim.normuon`); `scale`
      and the decay then apply as above. Sharded matrices carry their rows' `v` to the owner and back in the same
      two exchanges (one more value per row), and the state is a DTensor sharded like the parameter's rows.
    - `cautious_weight_decay=True`: Cautious Weight Decay (arXiv:2510.12402): the decay applies only where the
      update and the parameter agree in sign, `p <- p - lr * weight_decay * p * [O * p >= 0]` elementwise (O the
      final update direction, after NorMuon when on), before the step.

    All constructor arguments are group hyperparameters; a param group may override any of them.

    Sharded parameters: on a mesh of W > 1 ranks, the step's sharded matrices (in param-group order, then parameter
    order, which every rank shares) are dealt round-robin, matrix i to rank i % W. A table of how many rows of each
    matrix every rank holds (uneven splits, such as FSDP2's `torch.chunk` split that leaves the last ranks fewer or
    zero rows, are fine) and which have a gradient comes from one small `all_gather`, at the first step and again
    only when this rank's own rows or gradients change (never in a steady run: the step reads nothing back then):
    matrices without a gradient on every rank are skipped (as torch skips them, e.g. frozen ones), and a gradient on
    some ranks only raises a RuntimeError on every rank instead of hanging. Then one `all_to_all_single` sends each
    owner every rank's rows of `u` (one flat buffer for all matrices; exact sizes, no padding); the owner runs
    Newton–Schulz on the whole matrix, so each matrix is orthogonalized exactly once in the job; a second
    `all_to_all_single` sends every rank its rows of `O` back, and each rank applies its own rows. The exchange
    buffers hold about one sharded copy of the matrices per rank. Plain tensors, meshes of one rank and replicated
    DTensors take the local path, with no collectives. The
    collectives run on the device of the local shards, which the group's backend must support (so FSDP2's CPU
    offload under NCCL is not supported). Of sharded matrix layouts only `Shard(0)` along one mesh dimension is
    supported, replicated along any others (HSDP's replica groups: each group orthogonalizes its own copy over the
    ranks it is sharded across, and all groups, holding the same gradient, reach the same update); others raise.

    Tensor-parallel matrices: a matrix also split by rows or columns along the last dimension of its mesh (the TP
    group, inside FSDP's row split) first has its `u` gathered over the TP group, one `all_gather` for all such
    matrices, so each rank holds whole rows of it (its TP group's share of FSDP's rows); from there it is stepped as
    above over FSDP's ranks, and each rank keeps its own rows or columns of the result. The cost over the FSDP-only
    step: that all-gather (the TP-split matrices' momentum once per TP rank), and the ranks of a TP group all do
    the same orthogonalizations (each owner's Newton–Schulz runs tp times in the job).

    Sharded expert stacks: FSDP2 splits a stack along dim 0, so each rank's shard holds whole experts (after a
    `torch.chunk` split, possibly none). Each rank runs the batched Newton–Schulz on its local experts and its own
    part of the momentum buffer, with no collectives and whatever mesh the stack lives on (such as an expert-parallel
    subgroup); a rank holding no experts runs it on an empty batch. Every placement of a stack must be `Shard(0)` or
    `Replicate()`; others (e.g. `Shard(1)`, which would split experts) raise.
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        adjust_lr: str = "spectral",
        orthogonalizer: str = "newton_schulz",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-10,
        cautious_weight_decay: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "adjust_lr": adjust_lr,
            "orthogonalizer": orthogonalizer,
            "normuon": normuon,
            "normuon_beta2": normuon_beta2,
            "normuon_eps": normuon_eps,
            "cautious_weight_decay": cautious_weight_decay,
        }
        super().__init__(params, defaults)
        self._tables: dict[dist.ProcessGroup, list[list[int]]] = {}
        """Each process group's row table (`muon_sharded.row_table`), kept between steps."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore as torch does; groups saved before the variant options existed get them off."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _VARIANTS_OFF.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as torch does, then check its hyperparameters and that every parameter is a 2-D matrix or a
        3-D stack of them."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            # leave the optimizer as it was before the call
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one Muon step on every parameter with a gradient; returns `closure()`'s loss when given one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        sharded: dict[dist.ProcessGroup, list[tuple[Tensor, dict[str, Any], MatrixWork | None]]] = {}
        split: dict[dist.ProcessGroup, list[tuple[MatrixWork, int]]] = {}
        gathered: list[MatrixWork] = []  # orthogonalized where they are once their TP parts are gathered
        for group in self.param_groups:
            for p in group["params"]:
                pg, tp = shard_group(p), tensor_split(p)
                work = None
                if tp is not None and p.grad is not None:
                    # its direction is needed before the TP gather below; the others' as they are stepped
                    work = self._work(p, group)
                    split.setdefault(tp[0], []).append((work, tp[1]))
                if pg is not None:
                    # every sharded param is listed, grad or not, so that all ranks agree on the matrix order
                    sharded.setdefault(pg, []).append((p, group, work))
                elif work is not None:
                    gathered.append(work)
                elif p.grad is not None:
                    work = self._work(p, group)
                    work.apply(*work.direction(work.u, work.v))
        for tp_group, works in split.items():
            gather_tensor_parallel(tp_group, works)
        for work in gathered:
            work.apply(*work.direction(work.u, work.v))
        for pg, params in sharded.items():
            step_sharded(pg, params, self._row_table, self._work)
        return loss

    def _work(self, p: Tensor, group: dict[str, Any]) -> MatrixWork:
        """The step's work on `p`: its momentum direction and, with NorMuon, its row state (made at the first
        step: zeros [..., A, 1], a DTensor sharded like `p`'s rows for a DTensor `p`)."""
        u = self._momentum_direction(p, group)
        if not group["normuon"]:
            return MatrixWork(p, group, u)
        state = self.state[p]
        if ROW_MOMENT not in state:
            state[ROW_MOMENT] = _row_state_like(p)
        v = local(state[ROW_MOMENT])
        return MatrixWork(p, group, u, v=v, v_state=v)

    def _row_table(self, pg: dist.ProcessGroup, mine: list[int], world: int, device: torch.device) -> list[list[int]]:
        """The rows of each matrix every rank of `pg` holds (`muon_sharded.row_table`, kept between steps); a
        method, so that `lmforge plan` can give an instance host-made tables (`lmforge.plan.muon`)."""
        return row_table(self._tables, pg, mine, world, device)

    def _momentum_direction(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """Update the momentum buffer and return the direction `u` to orthogonalize, both as this rank's rows (of a
        stack: its experts)."""
        if p.grad.is_sparse or torch.is_complex(p):
            raise RuntimeError(f"Muon supports dense real gradients only (parameter of shape {tuple(p.shape)})")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = local(state["momentum_buffer"])
        grad = local(p.grad)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _apply_update(work: MatrixWork, ortho_rows: Tensor) -> None:
    """Decoupled weight decay (cautious or not), then the scaled orthogonalized step, on this rank's rows of the
    parameter."""
    group = work.group
    lr = float(group["lr"])
    rows, cols = work.param.shape[-2:]  # for an expert stack, each expert's shape
    p = local(work.param)
    if group["weight_decay"]:
        if group["cautious_weight_decay"]:
            # decay only where it pulls the same way as the update (u * p >= 0); the update is a positive multiple
            # of ortho_rows, and signs rather than the product avoid an underflow to 0 deciding the mask
            agree = torch.sign(ortho_rows).mul_(torch.sign(p)) >= 0
            p.sub_(torch.where(agree, p, 0), alpha=lr * group["weight_decay"])
        else:
            p.mul_(1 - lr * group["weight_decay"])
    p.add_(ortho_rows, alpha=-lr * ADJUST_LR[group["adjust_lr"]](rows, cols))


def _row_state_like(p: Tensor) -> Tensor:
    """Zeros [..., A, 1] for a parameter [..., A, B], in its dtype and on its device; for a DTensor, a DTensor on the
    same mesh whose rows are split as the parameter's (a split of the columns becomes a replication), so that each
    rank holds its own rows' state and checkpoints save and reload it like the momentum buffer."""
    mine = local(p)
    zeros = torch.zeros((*mine.shape[:-1], 1), dtype=mine.dtype, device=mine.device)
    if DTensor is None or not isinstance(p, DTensor):
        return zeros
    last = p.ndim - 1
    placements = [Replicate() if pl.is_shard(last) else pl for pl in p.placements]
    shape = torch.Size((*p.shape[:-1], 1))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(zeros, p.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def _check_group(group: dict[str, Any]) -> None:
    """Reject hyperparameters Muon cannot use and parameters that are neither matrices nor stacks of them."""
    for p in group["params"]:
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon optimizes 2-D matrices and 3-D stacks of them [E, A, B], got a parameter of shape "
                f"{tuple(p.shape)}"
            )
    if not float(group["lr"]) >= 0:
        raise ValueError(f"Muon: lr must be >= 0, got {group['lr']}")
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"Muon: momentum must be in [0, 1), got {group['momentum']}")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"Muon: weight_decay must be >= 0, got {group['weight_decay']}")
    if not (isinstance(group["ns_steps"], int) and group["ns_steps"] >= 0):
        raise ValueError(f"Muon: ns_steps must be an int >= 0, got {group['ns_steps']!r}")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(f"Muon: ns_coefficients must be 3 floats (a, b, c), got {group['ns_coefficients']!r}")
    if not group["eps"] > 0:
        raise ValueError(f"Muon: eps must be > 0, got {group['eps']}")
    if group["adjust_lr"] not in ADJUST_LR:
        raise ValueError(f"Muon: adjust_lr must be one of {sorted(ADJUST_LR)}, got {group['adjust_lr']!r}")
    if group["orthogonalizer"] not in ORTHOGONALIZERS:
        raise ValueError(
            f"Muon: orthogonalizer must be one of {list(ORTHOGONALIZERS)}, got {group['orthogonalizer']!r}"
        )
    if not 0 <= group["normuon_beta2"] < 1:
        raise ValueError(f"Muon: normuon_beta2 must be in [0, 1), got {group['normuon_beta2']}")
    if not group["normuon_eps"] > 0:
        raise ValueError(f"Muon: normuon_eps must be > 0, got {group['normuon_eps']}")


_VARIANTS_OFF: dict[str, Any] = {
    "orthogonalizer": "newton_schulz",
    "normuon": False,
    "normuon_beta2": 0.95,
    "normuon_eps": 1e-10,
    "cautious_weight_decay": False,
}
"""The variant options' defaults (all off), for groups of state dicts saved before the options existed."""
