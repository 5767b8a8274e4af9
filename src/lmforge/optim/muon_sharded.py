"""Where Muon's matrices live and how their rows move between ranks.

Newton–Schulz is not elementwise: a matrix must be orthogonalized whole. This module reads a parameter's DTensor
placements to tell how its rows are spread (`shard_group`: FSDP2 and HSDP row shards; `tensor_split`: a
tensor-parallel split of its rows or columns) and moves the rows so that each matrix is whole on one rank:
`gather_tensor_parallel` gathers a TP-split matrix's parts on every rank of its TP group, and `step_sharded` deals
the matrices sharded over a group round-robin to owner ranks, sends each owner the rows (and NorMuon's row state)
of its matrices in one all-to-all, and sends the orthogonalized rows back in a second one. What a step does to
one whole matrix is the caller's (`lmforge.optim.muon`): the work objects passed in know their update direction
`u`, row state `v`, `direction(...)` and `apply(...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if dist.is_available():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
else:  # a torch built without distributed support can still use the local path
    DTensor = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from lmforge.optim.muon import MatrixWork as Work


def local(t: Tensor) -> Tensor:
    """This rank's part of `t` (a DTensor's local tensor, else `t`)."""
    # in-place ops on a DTensor's local view write through to the DTensor's storage
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def shard_group(p: Tensor) -> dist.ProcessGroup | None:
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
    if tensor_split(p) is not None:
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


def tensor_split(p: Tensor) -> tuple[dist.ProcessGroup, int] | None:
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


def row_table(tables: dict[dist.ProcessGroup, list[list[int]]], pg: dist.ProcessGroup, mine: list[int], world: int,
              device: torch.device) -> list[list[int]]:  # fmt: skip
    """How many rows of each matrix every rank of `pg` holds (`mine`: this rank's, -1 where it has no
    gradient), so that all ranks take the same decisions and size the exchanges alike. One small all_gather
    (and its host read) makes the table; it is kept and used again while this rank's own column stays the same,
    which in a run is every step after the first: the rows are fixed by the sharding, and FSDP2 gives a sharded
    parameter its gradient on every rank of its mesh together. `tables` keeps each group's table between steps."""
    kept = tables.get(pg)
    if kept is not None and kept[dist.get_rank(pg)] == mine:
        return kept
    table = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(table, torch.tensor(mine, dtype=torch.int64, device=device), group=pg)
    rows = [t.tolist() for t in table]
    tables[pg] = rows
    return rows


def step_sharded(
    pg: dist.ProcessGroup,
    params: list[tuple[Tensor, dict[str, Any], Work | None]],
    table: Callable[[dist.ProcessGroup, list[int], int, torch.device], list[list[int]]],
    make_work: Callable[[Tensor, dict[str, Any]], Work],
) -> None:
    """Step the matrices sharded over `pg` (each with its group and, when its TP parts were gathered, its work):
    each is orthogonalized whole by its owner and its rows sent back. `make_work` makes the others' work (the
    momentum direction) as they are reached; `table` gives the row table of the group (`row_table`, or the
    planner's host-made one)."""
    world = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    device = local(params[0][0]).device

    mine_rows = [
        w.u.shape[0] if w is not None else local(p).shape[0] if p.grad is not None else -1 for p, _, w in params
    ]
    rows_by_rank = table(pg, mine_rows, world, device)  # [rank][param]
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
    work = [params[j][2] or make_work(*params[j][:2]) for j in keep]
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


def gather_tensor_parallel(group: dist.ProcessGroup, works: list[tuple[Work, int]]) -> None:
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
