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

from lmforge.optim.normuon import normalize_rows
from lmforge.optim.polar import DEFAULT_NS_COEFFICIENTS, newton_schulz, polar_express

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard
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


def _local(t: Tensor) -> Tensor:
    # in-place ops on a DTensor's local view write through to the DTensor's storage
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _shard_group(p: Tensor) -> dist.ProcessGroup | None:
    """The process group over whose ranks a 2-D matrix's rows are split, or None when this rank's part can be
    orthogonalized where it is: a whole matrix, or the whole experts of a 3-D stack."""
    if DTensor is None or not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    if p.ndim == 3:
        # split along experts, every rank's shard holds whole experts, so per-expert Muon needs no collective (and
        # no assumption about which ranks the mesh spans: expert parallelism puts stacks on their own mesh)
        if not all(pl.is_replicate() or pl.is_shard(0) for pl in p.placements):
            raise NotImplementedError(
                f"Muon orthogonalizes a 3-D expert stack per expert, on each rank's own experts, so the stack must "
                f"be split along dim 0 (Shard(0), FSDP2's default) or replicated; got placements {p.placements} "
                f"on a {mesh.ndim}-D mesh for a parameter of shape {tuple(p.shape)}"
            )
        return None
    if mesh.size() == 1 or all(pl.is_replicate() for pl in p.placements):
        return None
    sharded = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if _tensor_split(p) is not None:
        sharded = sharded[:-1]  # the rows each rank holds once its tensor-parallel part is gathered
        if not sharded:
            return None
    if len(sharded) != 1 or not _rows_split(p.placements[sharded[0]]):
        raise NotImplementedError(
            f"Muon supports DTensors sharded Shard(0) along one mesh dimension and replicated along the others "
            f"(FSDP2 and HSDP), got placements {p.placements} on a {mesh.ndim}-D mesh for a parameter of shape "
            f"{tuple(p.shape)}"
        )
    if mesh.size(sharded[0]) == 1:
        return None  # replica groups of one rank: each holds whole matrices
    # Under HSDP every replica group holds the same gradient (reduced across the groups), so each orthogonalizes
    # its own copy over the ranks it is sharded across, and all groups reach the same update.
    return mesh.get_group(sharded[0])


def _rows_split(placement: Any) -> bool:
    """Whether a placement splits a matrix by rows: `Shard(0)`, or FSDP2's strided `Shard(0)` outside a
    tensor-parallel split of the same dimension."""
    return placement.is_shard(0) or (isinstance(placement, _StridedShard) and placement.dim == 0)


def _tensor_split(p: Tensor) -> tuple[dist.ProcessGroup, int] | None:
    """For a matrix split by tensor parallelism (its columns, or its rows inside FSDP's rows, on the mesh's last
    dimension), the TP group and the dimension it splits; None for any other layout (a row split on its own is
    FSDP's, `_shard_group`)."""
    if DTensor is None or not isinstance(p, DTensor) or p.ndim != 2:
        return None
    mesh, placements = p.device_mesh, p.placements
    last = placements[-1]
    sharded = [pl for pl in placements if not pl.is_replicate()]
    if mesh.size(mesh.ndim - 1) == 1 or not (last.is_shard(1) or (last.is_shard(0) and len(sharded) > 1)):
        return None
    return mesh.get_group(mesh.ndim - 1), 0 if last.is_shard(0) else 1


def _flat_cat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in parts])


def _same(rows: Tensor) -> Tensor:
    return rows


@dataclass
class _Matrix:
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
    the rows hold every TP rank's part; see `_gather_tensor_parallel`)."""
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
        """Each process group's row table (`_row_table`), kept between steps."""

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

        sharded: dict[dist.ProcessGroup, list[tuple[Tensor, dict[str, Any], _Matrix | None]]] = {}
        split: dict[dist.ProcessGroup, list[tuple[_Matrix, int]]] = {}
        gathered: list[_Matrix] = []  # orthogonalized where they are once their TP parts are gathered
        for group in self.param_groups:
            for p in group["params"]:
                pg, tp = _shard_group(p), _tensor_split(p)
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
            _gather_tensor_parallel(tp_group, works)
        for work in gathered:
            work.apply(*work.direction(work.u, work.v))
        for pg, params in sharded.items():
            self._step_sharded(pg, params)
        return loss

    def _work(self, p: Tensor, group: dict[str, Any]) -> _Matrix:
        """The step's work on `p`: its momentum direction and, with NorMuon, its row state (made at the first
        step: zeros [..., A, 1], a DTensor sharded like `p`'s rows for a DTensor `p`)."""
        u = self._momentum_direction(p, group)
        if not group["normuon"]:
            return _Matrix(p, group, u)
        state = self.state[p]
        if ROW_MOMENT not in state:
            state[ROW_MOMENT] = _row_state_like(p)
        v = _local(state[ROW_MOMENT])
        return _Matrix(p, group, u, v=v, v_state=v)

    def _momentum_direction(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """Update the momentum buffer and return the direction `u` to orthogonalize, both as this rank's rows (of a
        stack: its experts)."""
        if p.grad.is_sparse or torch.is_complex(p):
            raise RuntimeError(f"Muon supports dense real gradients only (parameter of shape {tuple(p.shape)})")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = _local(state["momentum_buffer"])
        grad = _local(p.grad)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _row_table(self, pg: dist.ProcessGroup, mine: list[int], world: int, device: torch.device) -> list[list[int]]:
        """How many rows of each matrix every rank of `pg` holds (`mine`: this rank's, -1 where it has no
        gradient), so that all ranks take the same decisions and size the exchanges alike. One small all_gather
        (and its host read) makes the table; it is kept and used again while this rank's own column stays the same,
        which in a run is every step after the first: the rows are fixed by the sharding, and FSDP2 gives a sharded
        parameter its gradient on every rank of its mesh together."""
        kept = self._tables.get(pg)
        if kept is not None and kept[dist.get_rank(pg)] == mine:
            return kept
        table = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(table, torch.tensor(mine, dtype=torch.int64, device=device), group=pg)
        rows = [t.tolist() for t in table]
        self._tables[pg] = rows
        return rows

    def _step_sharded(self, pg: dist.ProcessGroup, params: list[tuple[Tensor, dict[str, Any], _Matrix | None]]) -> None:
        """Step the matrices sharded over `pg` (each with its group and, when its TP parts were gathered, its work):
        each is orthogonalized whole by its owner and its rows sent back."""
        world = dist.get_world_size(pg)
        rank = dist.get_rank(pg)
        device = _local(params[0][0]).device

        mine_rows = [
            w.u.shape[0] if w is not None else _local(p).shape[0] if p.grad is not None else -1 for p, _, w in params
        ]
        rows_by_rank = self._row_table(pg, mine_rows, world, device)  # [rank][param]
        keep = []
        for j, (p, _, _) in enumerate(params):
            held = [rows_by_rank[r][j] for r in range(world)]
            if all(n < 0 for n in held):
                continue
            if any(n < 0 for n in held):
                raise RuntimeError(f"Muon: a {tuple(p.shape)} parameter has a gradient on some ranks only")
            if sum(held) != p.shape[0]:
                raise RuntimeError(f"Muon: the ranks hold {held} rows of a {tuple(p.shape)} parameter")
            keep.append(j)
        if not keep:
            return
        work = [params[j][2] or self._work(*params[j][:2]) for j in keep]
        rows = [[rows_by_rank[r][j] for j in keep] for r in range(world)]  # [rank][matrix]
        cols = [w.u.shape[1] for w in work]
        # NorMuon's row state travels with its rows, as one more value per row after the matrix's block of u
        width = [c + (w.v is not None) for c, w in zip(cols, work, strict=True)]
        dtype = work[0].u.dtype
        for w in work:
            dtype = torch.promote_types(dtype, w.u.dtype)
            if w.v is not None:
                dtype = torch.promote_types(dtype, w.v.dtype)

        n = len(work)
        owned_by = [[i for i in range(n) if i % world == r] for r in range(world)]
        mine = owned_by[rank]

        # exchange 1: each rank sends its rows of u (and v) to each matrix's owner; sizes are known everywhere from
        # the row table, so all_to_all_single needs no padding
        send_splits = [sum(rows[rank][i] * width[i] for i in owned_by[d]) for d in range(world)]
        recv_splits = [sum(rows[s][i] * width[i] for i in mine) for s in range(world)]
        send = _flat_cat(
            [t for d in range(world) for i in owned_by[d] for t in (work[i].u, work[i].v) if t is not None],
            dtype,
            device,
        )
        for w in work:
            w.u, w.v = None, None  # type: ignore[assignment]  # the send buffer holds them; frees nesterov's temporary
        recv = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=pg)
        del send

        pieces: dict[int, list[tuple[Tensor, Tensor | None]]] = {i: [] for i in mine}
        for s, from_s in enumerate(recv.split(recv_splits)):
            for i, flat in zip(mine, from_s.split([rows[s][i] * width[i] for i in mine]), strict=True):
                pieces[i].append(_rows_of(flat, rows[s][i], cols[i], width[i]))
        ortho: dict[int, tuple[Tensor, Tensor | None]] = {}
        for i in mine:
            full_v = torch.cat([v for _, v in pieces[i]]) if width[i] > cols[i] else None  # type: ignore[misc]
            o, v = work[i].direction(torch.cat([u for u, _ in pieces[i]]), full_v)
            ortho[i] = (o.to(dtype), None if v is None else v.to(dtype))
        del pieces, recv

        # exchange 2: the owner sends each rank its rows of the orthogonalized matrix (and their new v)
        first_row = [[sum(rows[r][i] for r in range(d)) for i in range(n)] for d in range(world)]
        back = _flat_cat(
            [
                t.narrow(0, first_row[d][i], rows[d][i])
                for d in range(world)
                for i in mine
                for t in ortho[i]
                if t is not None
            ],
            dtype,
            device,
        )
        del ortho
        received = back.new_empty(sum(send_splits))
        dist.all_to_all_single(received, back, send_splits, recv_splits, group=pg)
        del back

        for d, from_d in enumerate(received.split(send_splits)):
            sizes = [rows[rank][i] * width[i] for i in owned_by[d]]
            for i, flat in zip(owned_by[d], from_d.split(sizes), strict=True):
                work[i].apply(*_rows_of(flat, rows[rank][i], cols[i], width[i]))


def _rows_of(flat: Tensor, rows: int, cols: int, width: int) -> tuple[Tensor, Tensor | None]:
    """One matrix's block of an exchange buffer: its rows [rows, cols], then (when `width` > `cols`) their row
    state [rows, 1]."""
    if width == cols:
        return flat.view(rows, cols), None
    u, v = flat.split([rows * cols, rows])
    return u.view(rows, cols), v.view(rows, 1)


def _gather_tensor_parallel(group: dist.ProcessGroup, works: list[tuple[_Matrix, int]]) -> None:
    """Replace each matrix's `u` (this rank's part of its rows: some of the rows, split along `dim` over the TP
    `group`) by the whole rows its TP group holds, in one all-gather for all of them, and set `take` to cut this
    rank's part back out of the result. Newton–Schulz commutes with permuting rows, so the order in which the
    gathered rows stand does not matter, only that the owner puts them back the same way."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mats = [w for w, _ in works]
    # a row split spreads the rows' NorMuon state too; under a column split every TP rank holds all of it already
    moves_v = [w.v is not None and dim == 0 for w, dim in works]
    dtype = mats[0].u.dtype
    for w, with_v in zip(mats, moves_v, strict=True):
        dtype = torch.promote_types(dtype, w.u.dtype)
        if with_v:
            dtype = torch.promote_types(dtype, w.v.dtype)  # type: ignore[union-attr]
    sent = [[w.u, w.v] if with_v else [w.u] for w, with_v in zip(mats, moves_v, strict=True)]
    flat = _flat_cat([t for ts in sent for t in ts], dtype, mats[0].u.device)
    gathered = flat.new_empty(size * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=group)
    parts = gathered.view(size, -1).split([sum(t.numel() for t in ts) for ts in sent], dim=1)
    for (w, dim), with_v, part in zip(works, moves_v, parts, strict=True):
        r, c = w.u.shape
        whole = part[:, : r * c].reshape(size, r, c)
        if dim == 0:  # rows split: rank 0's rows, then rank 1's, and so on
            w.u = whole.reshape(size * r, c)
            w.take = lambda o, r=r: o.narrow(0, rank * r, r)
            if with_v:
                w.v = part[:, r * c :].reshape(size * r, 1)
                w.take_v = lambda v, r=r: v.narrow(0, rank * r, r)
        else:  # columns split: the ranks' columns side by side
            w.u = whole.permute(1, 0, 2).reshape(r, size * c)
            w.take = lambda o, c=c: o.narrow(1, rank * c, c)


def _apply_update(work: _Matrix, ortho_rows: Tensor) -> None:
    """Decoupled weight decay (cautious or not), then the scaled orthogonalized step, on this rank's rows of the
    parameter."""
    group = work.group
    lr = float(group["lr"])
    rows, cols = work.param.shape[-2:]  # for an expert stack, each expert's shape
    p = _local(work.param)
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
    local = _local(p)
    zeros = torch.zeros((*local.shape[:-1], 1), dtype=local.dtype, device=local.device)
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
