"""Hugging Face model folders: what a run writes (`model/`, exports) and what inference loads.

A folder holds `config.json` (a plain `LlamaForCausalLM` / `Qwen3ForCausalLM`), `generation_config.json`, the
tokenizer files, and `model.safetensors` (or shards plus `model.safetensors.index.json`) once exported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lmforge.checkpoint.layout import MODEL_FILES, CheckpointError, find_checkpoint
from lmforge.checkpoint.load import load_model_weights
from lmforge.config.arch import AnyArch
from lmforge.config.hf_config import (
    HFModelError,
    HFModelInfo,
    arch_to_hf_config,
    generation_config,
    read_hf_config,
)
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.hf.names import export_tensors
from lmforge.hf.weights import load_hf_weights, require_safetensors, write_safetensors
from lmforge.model import build_model
from lmforge.model.llama import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_model_files(
    folder: Path,
    arch: AnyArch,
    vocab_size: int,
    tokenizer: TokenizerInfo | None,
    dtype: str = "float32",
    init_std: float = 0.02,
) -> None:
    """Write config.json, generation_config.json and the tokenizer's files (not the weights) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = {
        "bos_id": tokenizer.bos_id if tokenizer else None,
        "eos_id": tokenizer.eos_id if tokenizer else None,
        "pad_id": tokenizer.pad_id if tokenizer else None,
    }
    config = arch_to_hf_config(arch, vocab_size, dtype=dtype, init_std=init_std, **ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(generation_config(**ids), indent=2) + "\n")
    if tokenizer is not None:
        copy_tokenizer_files(tokenizer.path, folder)


def copy_tokenizer_files(tokenizer_json: Path, dst: Path) -> None:
    """Copy a tokenizer.json file (under that name) and whichever companion files sit beside it into `dst`."""
    sources = {"tokenizer.json": tokenizer_json}
    sources.update({name: tokenizer_json.parent / name for name in TOKENIZER_FILES[1:]})
    for name, src in sources.items():
        if src.is_file() and src.resolve() != (dst / name).resolve():
            shutil.copy2(src, dst / name)


def _checkpoint_of(path: Path) -> Path:
    ckpt = find_checkpoint(path, "latest", why="")
    assert ckpt is not None
    if not (ckpt / MODEL_FILES / "config.json").is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no {MODEL_FILES}/config.json: it cannot be exported")
    return ckpt


def is_hf_folder(path: Path) -> bool:
    """Whether `path` is an HF model folder with weights (as opposed to a run directory or checkpoint)."""
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def load_pretrained(
    path: Path, device: torch.device | str = "cpu", attn: str = "sdpa"
) -> tuple[CausalLM, TokenizerInfo | None]:
    """A model for inference from an HF folder, a run directory (its latest checkpoint) or a checkpoint folder,
    with the tokenizer stored beside it (None if there is none), attending with `attn` (`model.attn`). No process
    group is needed."""
    if (path / "config.json").is_file():
        # An HF folder: one without safetensors weights (pickle ones, say) is refused here, not taken for a run.
        require_safetensors(path)
        files = path
    elif path.is_dir():
        files = _checkpoint_of(path) / MODEL_FILES
    else:
        raise HFModelError(f"{path}: not a model folder, run directory or checkpoint")
    model, _ = _model_from(files, checkpoint=files is not path, attn=attn)
    tokenizer = load_tokenizer(files) if (files / "tokenizer.json").is_file() else None
    return model.to(device).eval(), tokenizer


def _model_from(files: Path, checkpoint: bool, attn: str = "sdpa") -> tuple[CausalLM, HFModelInfo]:
    # `files` holds config.json; the weights are its safetensors, or the DCP shards of the checkpoint around it.
    info = read_hf_config(files)
    model = build_model(info.arch, info.vocab_size, attn, torch.device("cpu"))
    if checkpoint:
        load_model_weights(files.parent, model)
    else:
        load_hf_weights(model, files)
    return model, info


def export_model(source: Path, output: Path, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a run's latest checkpoint (or the given checkpoint) as a plain HF folder; returns the checkpoint used.

    The folder is assembled under a temporary name and renamed, so `output` is either complete or absent.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty; choose another --output or remove it")
    ckpt = _checkpoint_of(source)
    files = ckpt / MODEL_FILES
    model, _ = _model_from(files, checkpoint=True)
    # HF names and layout: routed experts split per expert, a tied head left out (HF ties it on load).
    tensors = export_tensors(model, DTYPES[dtype])
    tmp = output.with_name(f".tmp_{output.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config = json.loads((files / "config.json").read_text())
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if (files / name).is_file():
            shutil.copy2(files / name, tmp / name)
    write_safetensors(tensors, tmp, max_shard_bytes)
    if output.exists():
        output.rmdir()
    tmp.rename(output)
    return ckpt
