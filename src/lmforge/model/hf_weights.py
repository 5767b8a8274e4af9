"""Safetensors checkpoints in the HF layout: one `model.safetensors`, or numbered shards with an index.

Loading reads one tensor at a time, so a model never needs a second full copy of its weights in memory, and it
works on plain parameters and on FSDP2-sharded (DTensor) parameters alike: every rank reads the file and keeps
its own shard, with no communication.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.model.hf_config import HFModelError

SINGLE_FILE = "model.safetensors"
"""Weights file of a checkpoint that fits in one shard."""

INDEX_FILE = "model.safetensors.index.json"
"""Index of a sharded checkpoint: which shard holds each tensor."""

_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# Buffers some HF versions save that lmforge computes on the fly.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def write_safetensors(tensors: dict[str, Tensor], out_dir: Path, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write `tensors` to `out_dir` in the HF layout and return the file names written.

    Everything in one `model.safetensors` when it fits in `max_shard_bytes`, else shards
    `model-00001-of-0000N.safetensors` filled in order (a tensor larger than the limit gets a shard of its own)
    plus `model.safetensors.index.json`. Checkpoint files from an earlier write to `out_dir` are removed first, so
    no stale shard or index can be mixed with the new weights.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(old.name):
            old.unlink()

    shards: list[dict[str, Tensor]] = [{}]
    shard_bytes = 0
    seen_storage: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (e.g. a tied matrix passed under two names).
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage and t.numel():
            t = t.clone()
        seen_storage.add(ptr)
        size = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += size

    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE_FILE), metadata=metadata)
        return [SINGLE_FILE]

    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total_size = 0
    total_parameters = 0
    for file_name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out_dir / file_name), metadata=metadata)
        for name, t in shard.items():
            weight_map[name] = file_name
            total_size += t.numel() * t.element_size()
            total_parameters += t.numel()
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Which file of the checkpoint in `folder` holds each tensor (a single file is preferred over an index)."""
    folder = Path(folder)
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single)
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise HFModelError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise HFModelError(f"{index_path}: not a safetensors index with a weight_map: {err!r}") from err
    files = {name: folder / file_name for name, file_name in weight_map.items()}
    absent = sorted({str(path.name) for path in files.values() if not path.is_file()})
    if absent:
        raise HFModelError(f"{index_path}: shard file(s) listed but not found: {', '.join(absent)}")
    return files


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: Path) -> None:
    """Copy the safetensors checkpoint in `folder` into `model`, one tensor at a time, cast to each parameter's dtype.

    Parameters may be plain tensors or FSDP2 DTensors; a DTensor receives only its local shard. Names must match
    exactly: a tied model takes its matrix from `model.embed_tokens.weight` and ignores a saved `lm_head.weight`.
    Names and shapes are all checked before any parameter is written, so a failed load leaves the model unchanged.
    """
    folder = Path(folder)
    files = checkpoint_files(folder)
    params = dict(model.named_parameters())
    # A tied matrix is listed once by named_parameters; its second name may still be in the checkpoint.
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)

    missing = sorted(set(params) - set(files))
    unexpected = sorted(
        name for name in set(files) - set(params) if name not in aliases and not name.endswith(_IGNORED_SUFFIXES)
    )
    if missing:
        raise HFModelError(f"{folder}: checkpoint lacks tensor(s) the model needs: {', '.join(missing)}")
    if unexpected:
        raise HFModelError(f"{folder}: checkpoint has tensor(s) the model does not: {', '.join(unexpected)}")

    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    raise HFModelError(
                        f"{path}: tensor {name} has shape {list(shape)} in the checkpoint but "
                        f"{list(params[name].shape)} in the model"
                    )

    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                _copy_into(params[name], f.get_tensor(name))


def _copy_into(param: Tensor, full: Tensor) -> None:
    """Write the full checkpoint tensor into a parameter, or into this rank's shard of a DTensor parameter."""
    if isinstance(param, DTensor):
        local = param.to_local()
        full = full.to(device=local.device, dtype=local.dtype)
        # src_data_rank=None: every rank holds the full tensor already, so each slices its own shard locally.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        local.copy_(shard.to_local())
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))
