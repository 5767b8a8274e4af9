"""Muon in a plan: sharded Muon reads one small table on the host (how many rows of each matrix every rank holds,
`Muon._row_table`), which fake tensors cannot give. The plan fills it on the host instead, with every rank holding
what rank 0 holds, which sizes Muon's gathers and scatters as an even sharding would."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lmforge.optim.muon import Muon


def _host_table(self: Muon, pg: dist.ProcessGroup, params: list[tuple[Tensor, dict[str, Any]]],
                world: int, device: Any) -> list[list[int]]:  # fmt: skip
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p, _ in params]
    mine = [t.shape[0] if p.grad is not None else -1 for t, (p, _) in zip(local, params, strict=True)]
    return [list(mine) for _ in range(world)]


@contextlib.contextmanager
def host_row_tables() -> Iterator[None]:
    """Within this block, Muon's row tables come from rank 0's own shards (see the module)."""
    original = Muon._row_table
    Muon._row_table = _host_table  # type: ignore[method-assign]
    try:
        yield
    finally:
        Muon._row_table = original  # type: ignore[method-assign]
