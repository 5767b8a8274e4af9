"""Building a model of an architecture, on the meta device or with CPU storage."""

from __future__ import annotations

import torch

from lmforge.config.arch import AnyArch
from lmforge.model.attention import resolve_backend
from lmforge.model.init import reset_buffers
from lmforge.model.llama import CausalLM


def build_model(
    arch: AnyArch, vocab_size: int, attn: str, device: torch.device, *, meta: bool = False, compiled: bool = False
) -> CausalLM:
    """Build the model of `arch` for `device`, which with `compiled` (blocks to be compiled) decides what the
    attention backend `auto` resolves to (`lmforge.model.attention.resolve_backend`).

    Parameters are fp32 and uninitialized: `init_weights`, a checkpoint or an HF folder fills them. With `meta`
    they have no storage yet (the trainer shards the model first, then allocates each rank's shards); otherwise
    they are allocated on the CPU, and buffers (an MoE block's selection bias and statistics) are zeroed. After
    `to_empty` of a meta model, `init_weights` and `load_hf_weights` set the buffers; a DCP load sets the
    selection bias but not the statistics (`CausalLM.reset_moe_stats`).
    """
    backend = resolve_backend(attn, device, compiled, arch.attention_sinks)
    with torch.device("meta"):
        model = CausalLM(arch, vocab_size, backend)
    if not meta:
        model.to_empty(device="cpu")
        model.tie_weights()
        reset_buffers(model)
    return model
