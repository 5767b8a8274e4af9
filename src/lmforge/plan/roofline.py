"""An operator-level roofline of a step traced on fake tensors.

Every aten operator the step dispatches costs the larger of its compute time (its FLOPs, from torch's own FLOP
formulas in `torch.utils.flop_counter`, over the GPU's peak for the operator's precision) and its memory time (the
bytes of its tensor inputs and outputs over the memory bandwidth). Views and allocations cost nothing; collectives
are counted by `lmforge.plan.collectives`. The sum assumes one kernel at a time with no launch overhead: an
estimate, a lower bound for eager execution.

The varlen flash-attention kernels are listed in `uncounted` instead: on fake tensors torch's formula cannot read
the sequence offsets and assumes every sequence as long as the longest, attending every pair; the plan counts
their FLOPs with lmforge's formula over the pairs the document mask attends (`lmforge.train.flops`). So is any
operator whose formula fails on fake tensors (its bytes still count).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from lmforge.plan.gpus import GpuSpec

GROUPED_MM_OPS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_weight_grad"})
"""Grouped matmuls (aten's and the routed experts' own, `lmforge.model.grouped_mm`), which torch has no FLOP formula
for: every row of the first operand meets one matrix of the second, 2 x rows x inner x outer FLOPs."""

ATTENTION_OPS = frozenset({"_flash_attention_forward", "_flash_attention_backward"})
"""Operators whose FLOPs the plan takes from lmforge's attention formula when torch cannot count them."""

_FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
                   "_to_copy_meta", "set_", "resize_", "record_stream"})  # fmt: skip
"""Operators that move no data."""


def _precision_factor(dtypes: set[torch.dtype]) -> float:
    """Peak of an operator's lowest input precision relative to the bf16 peak (fp32 matmuls run as TF32)."""
    if dtypes & {torch.float8_e4m3fn, torch.float8_e5m2}:
        return 2.0
    if dtypes & {torch.bfloat16, torch.float16}:
        return 1.0
    return 0.5


def _is_view(func: torch._ops.OpOverload) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class Roofline(TorchDispatchMode):
    """Sums, over the operators dispatched inside it, FLOPs, bytes and roofline time on `gpu`."""

    def __init__(self, gpu: GpuSpec) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.gpu = gpu
        self.formulas = flop_registry
        self.flops = 0.0
        """FLOPs torch's formulas counted."""
        self.bytes = 0.0
        """Bytes read and written by the counted operators."""
        self.seconds = 0.0
        """Roofline time of the counted operators."""
        self.compute_bound_seconds = 0.0
        """The part of `seconds` spent in operators limited by compute, not memory."""
        self.uncounted: Counter[str] = Counter()
        """Calls of operators without a usable FLOP formula here, by name (their bytes are still counted)."""
        self.uncounted_bytes = 0.0
        """Bytes of those calls."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace not in ("aten", "lmforge") or name in _FREE or _is_view(func):
            return out
        result = out
        if any(isinstance(t, DTensor) for t in tree_flatten((args, kwargs, out))[0]):
            # Tensor parallelism: the GPU runs the operator on this rank's parts (its collectives count apart).
            args, kwargs, out = tree_map_only(DTensor, lambda t: t._local_tensor, (args, kwargs, out))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        moved = float(sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values()))
        memory_s = moved / self.gpu.hbm_bytes_s
        flops = 0.0
        if name in ATTENTION_OPS:
            self._uncounted(name, moved)
            return result
        formula = self.formulas.get(func._overloadpacket)
        if name in GROUPED_MM_OPS:
            flops = 2.0 * args[0].numel() * args[1].shape[-1]
        elif formula is not None:
            try:
                flops = float(formula(*args, **kwargs, out_val=out))
            except Exception:
                self._uncounted(name, moved)
                return result
        floats = {t.dtype for t in tensors if t.is_floating_point()}
        compute_s = flops / (self.gpu.peak_flops * _precision_factor(floats)) if flops else 0.0
        self.flops += flops
        self.bytes += moved
        self.seconds += max(compute_s, memory_s)
        if compute_s > memory_s:
            self.compute_bound_seconds += compute_s
        return result

    def _uncounted(self, name: str, moved: float) -> None:
        """An operator whose FLOPs are counted elsewhere (or not at all): its memory time only."""
        self.uncounted[name] += 1
        self.uncounted_bytes += moved
        self.bytes += moved
        self.seconds += moved / self.gpu.hbm_bytes_s
