"""Safetensors checkpoints in the HF layout: one `model.safetensors`, or numbered shards with an index.

`hf_names.export_tensors(model, dtype)` gives the tensors to write for a model (MoE experts per expert);
`write_safetensors` writes them.

Loading reads one tensor at a time, so a model never needs a second full copy of its weights in memory, and it
works on plain parameters and on FSDP2-sharded (DTensor) parameters alike: every rank reads the file and keeps
its own shard, with no communication.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.config.hf_config import HFModelError
from lmforge.hf.names import checkpoint_sources, ignored_checkpoint_name, persistent_buffers
from lmforge.model.moe import MoE
from lmforge.parallel.experts import global_view

SINGLE_FILE = "model.safetensors"
"""Weights file of a checkpoint that fits in one shard."""

INDEX_FILE = "model.safetensors.index.json"
"""Index of a sharded checkpoint: which shard holds each tensor."""

_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weight files in a pickle format (`pytorch_model.bin`, `*.pt`, ...): never loaded, since unpickling a file can run
whatever code it holds."""

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


def require_safetensors(folder: Path) -> None:
    """Raise HFModelError unless `folder` holds safetensors weights; the message names pickle weight files found
    instead (`pytorch_model.bin` and the like), which lmforge refuses to load."""
    folder = Path(folder)
    if (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file():
        return
    message = f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found"
    pickled = sorted(p.name for p in folder.glob("*") if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickled:
        message += (
            f"; {', '.join(pickled)} hold(s) PyTorch pickle weights, which lmforge does not load (unpickling a file "
            "can run any code it holds). Convert them to safetensors where you trust their source, e.g. with "
            "transformers: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out)"
        )
    raise HFModelError(message)


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Which file of the checkpoint in `folder` holds each tensor (a single file is preferred over an index)."""
    folder = Path(folder)
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single)
    require_safetensors(folder)
    index_path = folder / INDEX_FILE
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
    """Copy the safetensors checkpoint in `folder` into `model`, one tensor at a time, cast to each tensor's dtype.

    Parameters may be plain tensors or FSDP2 DTensors; a DTensor receives only its local shard. Persistent buffers
    (an MoE router's selection bias) load like parameters; MoE statistics are zeroed. Names must match exactly, up
    to the routed experts, which come from per-expert tensors or from stacked ones (`hf_names`); a tied model takes
    its matrix from `model.embed_tokens.weight` and ignores a saved `lm_head.weight`. Names and shapes are all
    checked before any tensor is written, so a failed load leaves the model unchanged.
    """
    folder = Path(folder)
    files = checkpoint_files(folder)
    # Under expert parallelism a rank's expert stacks are pieces of whole ones: name them whole, as files hold them.
    targets = global_view({**dict(model.named_parameters()), **persistent_buffers(model)}, model)
    # A tied matrix is listed once by named_parameters; its second name may still be in the checkpoint.
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(targets)
    sources = checkpoint_sources(targets, set(files), getattr(model, "arch", None))

    needed = [name for source in sources.values() for name in source.names]
    missing = [name for name in needed if name not in files]
    used = set(needed) | aliases
    unexpected = sorted(
        name
        for name in set(files) - used
        if not name.endswith(_IGNORED_SUFFIXES) and not ignored_checkpoint_name(name, model)
    )
    if missing:
        raise HFModelError(f"{folder}: checkpoint lacks tensor(s) the model needs: {_listing(missing)}")
    if unexpected:
        raise HFModelError(f"{folder}: checkpoint has tensor(s) the model does not: {_listing(unexpected)}")

    with ExitStack() as stack:
        opened = {path: stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                  for path in sorted({files[name] for name in needed})}  # fmt: skip
        for target, source in sources.items():
            expected = source.piece_shapes(tuple(targets[target].shape))
            for name, want in zip(source.names, expected, strict=True):
                shape = tuple(opened[files[name]].get_slice(name).get_shape())
                if shape != want:
                    raise HFModelError(
                        f"{files[name]}: tensor {name} has shape {list(shape)} in the checkpoint but "
                        f"{list(want)} in the model" + ("" if name == target else f" (as part of {target})")
                    )
        for target, source in sources.items():
            pieces = [opened[files[name]].get_tensor(name) for name in source.names]
            _copy_into(targets[target], source.assemble(pieces))
    for module in model.modules():
        if isinstance(module, MoE):
            module.reset_stats()


def _listing(names: list[str], limit: int = 20) -> str:
    """Names joined for an error message, the first `limit` of them."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


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
