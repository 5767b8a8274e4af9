"""What a checkpoint holds of the live objects: the model's and optimizers' state dicts with wrapped tensors
unwrapped, so the files hold plain tensors (an FP8 run resumes without FP8, and exports need no torchao)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _plain(t: Any) -> Any:
    """`t` without a tensor subclass that only wraps one tensor of the same shape and dtype (torchao's float8
    weights under FSDP: `model.fp8`); a DTensor keeps its layout around the unwrapped shard. The plain tensor shares
    the wrapper's storage, so loading into it loads the live parameter."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    flatten = getattr(local, "__tensor_flatten__", None)
    if type(local) is torch.Tensor or type(local) is nn.Parameter or flatten is None:
        return t
    names, _ = flatten()
    inner = getattr(local, names[0]) if len(names) == 1 else None
    if not isinstance(inner, torch.Tensor) or inner.shape != local.shape or inner.dtype != local.dtype:
        return t
    if isinstance(t, DTensor):
        return DTensor.from_local(inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return inner


def plain_state(state: Any) -> Any:
    """A checkpoint payload (nested dicts and lists) with its wrapped tensors unwrapped (`_plain`): the files then
    hold plain tensors, which load without the library that wrapped them (an FP8 run resumes without FP8, and
    exports need no torchao)."""
    if isinstance(state, dict):
        return {k: plain_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_state(v) for v in state]
    return _plain(state) if isinstance(state, torch.Tensor) else state


def optimizers_of(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers behind the trainer's optimizer (an `Optimizers` set, or a single one)."""
    return tuple(getattr(optimizer, "optimizers", (optimizer,)))
