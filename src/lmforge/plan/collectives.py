"""Collective traffic of a step traced on a fake process group: bytes per kind and their time on the target
network.

torch's own bookkeeping of collectives (`torch.distributed._tools.fake_collectives.CollectiveOp`) says which
process group and how many bytes each c10d operator moves. A ring algorithm sends (n - 1) / n of the buffer per
rank for an all-gather, a reduce-scatter and an all-to-all, and twice that for an all-reduce; a group within one
node runs at NVLink's bandwidth, one that spans nodes at the network's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.plan.gpus import GpuSpec

_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
}
"""c10d operator -> the kind of collective it is."""

IN_LINE = "(tp)"
"""The suffix of a collective kind run on the tensor-parallel group, which no compute overlaps."""


@dataclass
class Traffic:
    """One kind of collective over a step, on one rank."""

    calls: int = 0
    """Number of calls."""
    buffer_bytes: float = 0.0
    """Size of the buffers the calls exchanged (the gathered output, the reduced input)."""
    sent_bytes: float = 0.0
    """Bytes this rank sends over the links (ring algorithm)."""
    seconds: float = 0.0
    """Time of those bytes on the links the groups use."""

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.calls - other.calls, self.buffer_bytes - other.buffer_bytes,
                       self.sent_bytes - other.sent_bytes, self.seconds - other.seconds)  # fmt: skip

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.calls + other.calls, self.buffer_bytes + other.buffer_bytes,
                       self.sent_bytes + other.sent_bytes, self.seconds + other.seconds)  # fmt: skip

    def times(self, n: int) -> Traffic:
        """This traffic `n` times over."""
        return Traffic(self.calls * n, self.buffer_bytes * n, self.sent_bytes * n, self.seconds * n)


def _wire_ratio(args: Any) -> float:
    """Bytes sent per byte of a collective's first tensor argument as its dtype counts them: a tensor subclass that
    carries its payload in `_data` (torchao's float8 training tensors, whose dtype is the high-precision one they
    stand for) sends the payload."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            data = getattr(arg, "_data", None)
            return data.element_size() / arg.element_size() if isinstance(data, torch.Tensor) else 1.0
    return 1.0


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched inside it, by kind, for `gpu`s with `gpus_per_node` GPUs a node."""

    def __init__(self, gpu: GpuSpec, gpus_per_node: int, in_line: frozenset[int] = frozenset()) -> None:
        """`in_line`: the ranks of this rank's TP group, whose collectives are counted under kinds of their own
        (`<kind> (tp)`): they sit between the operators that need their results, so nothing hides them."""
        super().__init__()
        self.gpu, self.gpus_per_node = gpu, gpus_per_node
        self.in_line = in_line
        self.traffic: dict[str, Traffic] = defaultdict(Traffic)
        """Kind -> traffic."""
        self.unknown = 0
        """Collectives whose size torch's bookkeeping could not give (this torch's `fake_collectives` changed)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _KINDS.get(func._overloadpacket.__name__)
        if kind is None or func.namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            return out
        try:
            from torch.distributed._tools.fake_collectives import CollectiveOp

            group = CollectiveOp.get_process_group(func, args)
            size = float(CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)) * _wire_ratio(args)
            ranks = dist.get_process_group_ranks(group)
        except Exception:
            self.unknown += 1
            return out
        n = len(ranks)
        if n <= 1:
            return out
        share = (n - 1) / n * (2.0 if kind == "all_reduce" else 1.0)
        one_node = len({r // self.gpus_per_node for r in ranks}) == 1
        bandwidth = self.gpu.intra_node_bytes_s if one_node else self.gpu.inter_node_bytes_s
        entry = self.traffic[f"{kind} {IN_LINE}" if self.in_line and set(ranks) == self.in_line else kind]
        entry.calls += 1
        entry.buffer_bytes += size
        entry.sent_bytes += share * size
        entry.seconds += share * size / bandwidth
        return out

    def snapshot(self) -> dict[str, Traffic]:
        """The traffic so far, by kind (a copy)."""
        return {kind: replace(t) for kind, t in self.traffic.items()}

    @property
    def seconds(self) -> float:
        """Time of every collective, one after the other."""
        return sum(t.seconds for t in self.traffic.values())
