"""Muon in a plan: sharded Muon reads one small table on the host (how many rows of each matrix every rank holds,
`Muon._row_table`, made by `lmforge.optim.muon_sharded.row_table`), which fake tensors cannot give. The plan's own
optimizers fill it on the host instead, with every rank holding what rank 0 holds, which sizes Muon's gathers and
scatters as an even sharding would."""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from lmforge.optim.muon import Muon


def _host_table(self: Muon, pg: dist.ProcessGroup, mine: list[int], world: int, device: Any) -> list[list[int]]:
    return [list(mine) for _ in range(world)]


def host_row_tables(optimizers: Iterable[Optimizer]) -> int:
    """Give each Muon among `optimizers` (and only those instances) row tables from rank 0's own shards (see the
    module); returns how many were given them."""
    given = 0
    for optimizer in optimizers:
        if isinstance(optimizer, Muon):
            optimizer._row_table = types.MethodType(_host_table, optimizer)  # type: ignore[method-assign]
            given += 1
    return given
