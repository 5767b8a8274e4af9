"""Model architectures, attention backends and weight init."""

from __future__ import annotations

import torch

from lmforge.model.attention import resolve_backend
from lmforge.model.config import ArchConfig, LlamaArch, Qwen3Arch
from lmforge.model.llama import CausalLM

__all__ = ["ArchConfig", "CausalLM", "LlamaArch", "Qwen3Arch", "build_model"]


def build_model(arch: LlamaArch | Qwen3Arch, vocab_size: int, attn: str, device: torch.device) -> CausalLM:
    """Build the model of `arch` on the CPU with default (unset) values; `attn` may be `auto`.

    The model is created on the CPU in fp32: the trainer initializes it and FSDP moves each shard to `device`.
    """
    backend = resolve_backend(attn, device)
    return CausalLM(arch, vocab_size, backend)
