"""Model architectures, attention backends and weight init."""

from __future__ import annotations

import torch

from lmforge.model.attention import resolve_backend
from lmforge.model.config import ArchConfig, LlamaArch, Qwen3Arch
from lmforge.model.llama import CausalLM

__all__ = ["ArchConfig", "CausalLM", "LlamaArch", "Qwen3Arch", "build_model"]


def build_model(
    arch: LlamaArch | Qwen3Arch, vocab_size: int, attn: str, device: torch.device, *, meta: bool = False
) -> CausalLM:
    """Build the model of `arch` for `device` (which picks the attention backend when `attn` is `auto`).

    Parameters are fp32 and uninitialized: `init_weights`, a checkpoint or an HF folder fills them. With `meta`
    they have no storage yet (the trainer shards the model first, then allocates each rank's shards); otherwise
    they are allocated on the CPU.
    """
    backend = resolve_backend(attn, device)
    with torch.device("meta"):
        model = CausalLM(arch, vocab_size, backend)
    if not meta:
        model.to_empty(device="cpu")
        model.tie_weights()
    return model
