"""Find, on the CPU, the operations that would make a CUDA step wait for the device.

On CUDA some operations cannot return before the host has read a device value: `.item()` and `bool()`/`int()` of a
tensor, `nonzero`, boolean-mask indexing, `unique`, `repeat_interleave` without `output_size`, `.tolist()`, ... Each
one stalls the CPU until the GPU has caught up, so the host can no longer queue kernels ahead. On a CPU-only machine
`torch.cuda.set_sync_debug_mode` has nothing to check, so `HostSyncDetector` finds them by what they are instead.

Device and host tensors are both CPU tensors here, so the detector tells them apart by where they came from:
- the model's parameters and buffers are device tensors (`watch_module`);
- `t.to(device)` and `t.cuda()` of a host tensor, with `device` a `torch.device`, upload it: the detector returns a
  copy marked as a device tensor, as CUDA would (a device given as the string "cpu" means the host);
- a tensor made with an explicit `device=` that is a `torch.device` is a device tensor;
- an op with a device tensor among its inputs puts its outputs, and the tensors it writes to, on the device.
Everything else, like a micro-batch's `doc_lens` (kept on the host on purpose) and what is computed from it, is a host
tensor, and reading it is free. A host-synchronizing op on a device tensor is recorded with the line of the project
(source or test) that issued it.

    detector = HostSyncDetector()
    detector.watch_module(model)
    with detector:
        run_step()
    assert not detector.events, detector.report()
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops that read a device value on the host on CUDA, whatever their arguments.
_ALWAYS_SYNC = {
    aten._local_scalar_dense.default,  # .item(), bool(), int(), float() of a tensor
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,  # the output size depends on the data
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,  # reads the maximum to size its output
    aten.histc.default,  # reads min and max when they are not given
}
# Python-level tensor methods that copy to the host without an aten op on a CPU tensor.
_SYNC_METHODS = {"tolist", "numpy", "cpu"}

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_SKIP_FILES = {str(Path(__file__).resolve())}


@dataclass(frozen=True)
class HostSync:
    """One recorded host read: the op, the first frame of the project that issued it, and the whole stack."""

    op: str
    where: str
    stack: str


def _data_dependent(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Ops that sync only for some arguments: boolean-mask indexing and `repeat_interleave` without a size."""
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return kwargs.get("output_size") is None
    return func in (aten.narrow.Tensor, aten.tensor_split.tensor_indices_or_sections)


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The arguments an op writes to (in-place and out= arguments), from its schema's alias annotations."""
    written = []
    schema = getattr(func, "_schema", None)
    if schema is None:
        return written
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written.extend(_tensors(value))
    return written


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncDetector) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        on_device = any(self.owner.is_device(t) for t in inputs)
        if on_device and (func in _ALWAYS_SYNC or _data_dependent(func, args, kwargs)):
            self.owner.record(str(func))
        out = func(*args, **kwargs)
        if on_device:
            self.owner.mark_device(*_tensors(out), *_written_args(func, args, kwargs))
        return out


def _is_device_spec(value: Any) -> bool:
    """A `torch.device` names the device under test; a string such as "cpu" names the host."""
    return isinstance(value, torch.device)


def _upload_target(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `Tensor.to(...)` / `Tensor.cuda()` moves its tensor to the device under test."""
    if name == "cuda":
        return True
    if name != "to":
        return False
    return _is_device_spec(kwargs.get("device")) or any(_is_device_spec(a) for a in args[1:])


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncDetector) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        self_tensor = args[0] if args and isinstance(args[0], Tensor) else None
        if self_tensor is not None and self.owner.is_device(self_tensor):
            to_host = name == "to" and "cpu" in (*args[1:], kwargs.get("device")) and not kwargs.get("non_blocking")
            if name in _SYNC_METHODS or to_host:
                self.owner.record(f"Tensor.{name}")
                if name == "cpu" or to_host:
                    # The host copy is a host tensor: reading it again (`.numpy()`) is free. On a CPU run the
                    # method returns the tensor itself, so a copy stands for it.
                    out = func(*args, **kwargs)
                    out = out.clone() if out is self_tensor else out
                    self.owner.unmark(out)
                    return out
        elif self_tensor is not None and _upload_target(name, args, kwargs):
            out = func(*args, **kwargs)
            # On a CPU run `.to(device)` returns the same tensor; a copy keeps the host original a host tensor.
            out = out.clone() if out is self_tensor else out
            self.owner.mark_device(out)
            return out
        out = func(*args, **kwargs)
        if _is_device_spec(kwargs.get("device")):
            self.owner.mark_device(*_tensors(out))
        return out


class HostSyncDetector:
    """Records every op on a device tensor that would wait for the device on CUDA, while it is entered."""

    def __init__(self) -> None:
        self.events: list[HostSync] = []
        # id -> weak reference: a WeakSet would compare tensors with ==, which is elementwise.
        self._device: dict[int, weakref.ref[Tensor]] = {}
        self._hooks: list[Any] = []
        self._modes: list[Any] = []

    def mark_device(self, *tensors: Tensor) -> None:
        """Say that these tensors live on the device."""
        for t in tensors:
            local = getattr(t, "_local_tensor", None)  # a DTensor's shard
            for x in (t, local) if isinstance(local, Tensor) else (t,):
                key = id(x)
                if not self.is_device(x):
                    self._device[key] = weakref.ref(x, lambda _ref, key=key: self._device.pop(key, None))

    def unmark(self, t: Tensor) -> None:
        """Say that `t` lives on the host."""
        self._device.pop(id(t), None)

    def is_device(self, t: Tensor) -> bool:
        """Whether `t` is a device tensor (marked, or computed from one)."""
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def watch_module(self, model: nn.Module) -> None:
        """Mark the model's parameters and buffers as device tensors at every module call, after the pre-forward
        hooks already registered (FSDP's, which swap in the unsharded parameters) have run."""
        self.mark_device(*model.parameters(), *model.buffers())

        def mark(module: nn.Module, _args: Any) -> None:
            self.mark_device(*module.parameters(recurse=False), *module.buffers(recurse=False))

        for module in model.modules():
            self._hooks.append(module.register_forward_pre_hook(mark))

    def record(self, op: str) -> None:
        """Record a host read by `op` at the current Python stack."""
        frames = [f for f in traceback.extract_stack() if f.filename not in _SKIP_FILES]
        mine = [f for f in frames if f.filename.startswith(str(_SOURCE_ROOT)) and "/.venv" not in f.filename]
        frame = (mine or frames)[-1]
        where = f"{Path(frame.filename).relative_to(_SOURCE_ROOT) if mine else frame.filename}:{frame.lineno}"
        self.events.append(HostSync(op, where, "".join(traceback.format_list(frames[-12:]))))

    def report(self) -> str:
        """The recorded host reads, one line each, then the first one's stack."""
        if not self.events:
            return "no host reads"
        lines = [f"{e.op} at {e.where}" for e in self.events]
        return "host reads inside the step:\n  " + "\n  ".join(lines) + "\nfirst one's stack:\n" + self.events[0].stack

    def __enter__(self) -> HostSyncDetector:
        self._modes = [_Function(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def close(self) -> None:
        """Remove the module hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def checked(detector: HostSyncDetector, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with each call run under `detector` (for a test to put in place of a loop it checks)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with detector:
            return fn(*args, **kwargs)

    return wrapper
