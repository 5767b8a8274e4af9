"""Reading checkpoints back into live, possibly sharded, objects: model and optimizer state, RNG state and the
trainer state, through the safe reader (a checkpoint from a path a user names runs no code)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lmforge.checkpoint.layout import CheckpointError, read_trainer_state
from lmforge.checkpoint.payload import optimizers_of, plain_state
from lmforge.checkpoint.rng_state import read_rng_state, set_rng_state
from lmforge.checkpoint.safe_load import SafeCheckpointReader, SafeLoadPlanner
from lmforge.model.llama import CausalLM
from lmforge.parallel.experts import global_view


def _load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """`dcp.load` of `state` from the checkpoint folder `path` through the safe reader and planner."""
    dcp.load(state, storage_reader=SafeCheckpointReader(str(path)), planner=SafeLoadPlanner(), **kwargs)


def _tensor_shapes(path: Path, prefix: str) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeCheckpointReader(str(path)).read_metadata()
    return {
        key[len(prefix) :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def check_model_shapes(path: Path, model: nn.Module) -> None:
    """Raise a CheckpointError listing every parameter that is missing, extra or of another shape."""
    saved = _tensor_shapes(path, "model.")
    expected = {name: tuple(t.shape) for name, t in global_view(model.state_dict(), model).items()}
    problems = [f"{n}: missing from the checkpoint" for n in sorted(expected.keys() - saved.keys())]
    # Under pipeline parallelism the parameters of other ranks' stages are the checkpoint's, not this rank's.
    elsewhere = model.held_elsewhere if isinstance(model, CausalLM) else lambda name: False
    extra = [n for n in sorted(saved.keys() - expected.keys()) if not elsewhere(n)]
    problems += [f"{n}: in the checkpoint but not in the model" for n in extra]
    problems += [
        f"{n}: checkpoint shape {list(saved[n])}, model shape {list(expected[n])}"
        for n in sorted(expected.keys() & saved.keys())
        if saved[n] != expected[n]
    ]
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise CheckpointError(f"checkpoint {path} does not fit the configured model:\n  " + "\n  ".join(shown))


def load_checkpoint(path: Path, model: nn.Module, optimizer: Any, rank: int) -> dict[str, Any]:
    """Load model (and optimizer, unless None) shards into the live, possibly sharded, objects; returns the
    trainer state. The optimizer's hyperparameters stay those of the current config: only its state is loaded.
    RNG states are restored when the checkpoint was written by the same world size."""
    state = read_trainer_state(path)
    if optimizer is None:
        load_model_state(path, model)
    else:
        check_model_shapes(path, model)
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        model_sd, optim_sd = get_state_dict(model, optimizers_of(optimizer))
        payload = plain_state({"model": model_sd, "optim": optim_sd})
        # The view shares the payload's storage: loading into it fills the payload. Only the optimizer's per-parameter
        # state is read: its groups' hyperparameters come from the config (below), and the groups' numbering is the
        # layout's own (under pipeline parallelism each rank holds some groups only).
        view = dict(global_view(payload, model))  # a new top level: the payload keeps its groups for set_state_dict
        view["optim"] = {key: value for key, value in view["optim"].items() if key != "param_groups"}
        _load(view, path)
        set_state_dict(
            model, optimizers_of(optimizer), model_state_dict=payload["model"], optim_state_dict=payload["optim"]
        )
        for group, saved in zip(optimizer.param_groups, hyper, strict=True):
            group.update(saved)
    rng = path / "rng" / f"rank_{rank}.pt"
    if state.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1) and rng.is_file():
        set_rng_state(read_rng_state(rng))
    return state


def load_model_state(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's or snapshot's model weights into the live, possibly sharded, model (every rank)."""
    check_model_shapes(path, model)
    model_sd = plain_state(get_model_state_dict(model))
    _load(global_view({"model": model_sd}, model), path)
    set_model_state_dict(model, model_sd)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's model weights into a plain (unsharded) module, without a process group."""
    check_model_shapes(path, model)
    state = model.state_dict()
    with warnings.catch_warnings():  # DCP warns that it runs without a process group, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _load({"model": state}, path, no_dist=True)
