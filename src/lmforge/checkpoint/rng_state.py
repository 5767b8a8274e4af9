"""The random number generator states of one rank (torch, Python, numpy, CUDA), in a checkpoint's
`rng/rank_<k>.pt`: written as tensors and plain values only, read with torch's restricted unpickler."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.checkpoint.layout import CheckpointError

RNG_FORMAT = 2
"""Layout of `rng/rank_<k>.pt`: tensors and plain Python values only, so that it loads with `weights_only=True`.
The first layout (no "format" key) held numpy's state as an array; `read_rng_state` still reads it."""


def _layout(torch_state: torch.Tensor, python_state: tuple[Any, ...], numpy_state: tuple[Any, ...],
            cuda_state: torch.Tensor | None) -> dict[str, Any]:  # fmt: skip
    """Generator states as `RNG_FORMAT` stores them, from `random.getstate()` and `np.random.get_state()`."""
    version, internal, gauss_next = python_state
    algorithm, key, pos, has_gauss, cached = numpy_state
    if not isinstance(key, np.ndarray) or key.dtype != np.uint32:
        raise TypeError(f"numpy key of type {getattr(key, 'dtype', type(key).__name__)}, expected uint32")
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "torch": torch_state,
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(algorithm),
            # uint32 words held as int64: exact, and a dtype every torch version serializes.
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if cuda_state is not None:
        state["cuda"] = cuda_state
    return state


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, as tensors, numbers and strings only (see `RNG_FORMAT`)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return _layout(torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True), cuda)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    py, nps = state["python"], state["numpy"]
    torch.set_rng_state(state["torch"])
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    key = nps["key"].numpy().astype(np.uint32)
    np.random.set_state((nps["algorithm"], key, nps["pos"], nps["has_gauss"], nps["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What unpickling a numpy array needs, under the module names numpy 1 and numpy 2 pickle it with. Building an
    array runs no code of the file's choosing; an object array's items still pass the restricted unpickler."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # numpy 2 pickles a dtype through its class; the key is uint32
    ]


_RNG_FIELDS = {"python": ("version", "state", "gauss_next"),
               "numpy": ("algorithm", "key", "pos", "has_gauss", "cached_gaussian")}  # fmt: skip


def _check_layout(state: Any) -> None:
    """Raise TypeError unless `state` has the fields `set_rng_state` reads, so a foreign file fails by name."""
    if not isinstance(state, dict):
        raise TypeError(f"expected a dict, found a {type(state).__name__}")
    if state.get("format") != RNG_FORMAT:
        raise TypeError(f"format {state.get('format')!r}, expected {RNG_FORMAT}")
    if not isinstance(state.get("torch"), torch.Tensor):
        raise TypeError("no torch generator state")
    for part, fields in _RNG_FIELDS.items():
        if not isinstance(state.get(part), dict) or any(f not in state[part] for f in fields):
            raise TypeError(f"{part!r} should be a dict with {', '.join(fields)}")
    if not isinstance(state["python"]["state"], torch.Tensor) or not isinstance(state["numpy"]["key"], torch.Tensor):
        raise TypeError("the Python state and the numpy key should be tensors")


def _refused_globals(path: Path) -> str:
    """The globals a refused file names, for the error message (found without unpickling it), or ""."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a torch.save zip file, or not even that: the message then only says it was refused
        return ""
    return f" (it refers to {', '.join(sorted(found))})" if found else ""


def read_rng_state(path: Path) -> dict[str, Any]:
    """The RNG states in a checkpoint's `rng/rank_<k>.pt`, read with torch's restricted unpickler only: a file that
    would need anything beyond tensors, plain values and (in the first layout) numpy arrays is refused with a
    CheckpointError naming it, before any of its objects is built."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            # The first layout holds numpy's state as an array: allow exactly what building one takes.
            with torch.serialization.safe_globals(_numpy_array_globals()):
                first = torch.load(path, map_location="cpu", weights_only=True)
            state = _layout(first["torch"], first["python"], first["numpy"], first.get("cuda"))
        _check_layout(state)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: refused to load the RNG states{_refused_globals(path)}: the file holds objects other than "
            "tensors and plain values, which lmforge never writes there. Delete the file to resume without "
            "restoring the random number generators."
        ) from err
    except (AttributeError, IndexError, KeyError, TypeError, ValueError, RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: not an RNG state file lmforge can read ({err})") from err
    return state
