"""Flex attention in a plan: torch runs flex attention's backward on CUDA only, and a plan traces its step on fake
CPU tensors, so where the run would take flex attention (`model.attn = "flex"`, or `auto` for a model with attention
sinks) the plan traces a stand-in with a fused kernel's footprint instead. It keeps what flex attention keeps for
backward (q, k, v, the output and the fp32 log-sum-exp) and computes nothing; its FLOPs come from lmforge's attention
formula, as the varlen kernels' do. Under context parallelism the keys and values are still gathered, so the plan
counts that collective."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lmforge.model.attention import DocumentMask, flex_attention_fn
from lmforge.model.llama import CausalLM
from lmforge.model.masks import padded_values
from lmforge.parallel.context import ContextAttention, gather_row


class _FusedKernelFootprint(torch.autograd.Function):
    """Attention output [T, Hq, Dv] with the tensors a fused kernel saves for backward; no values computed."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.with_sinks = sinks is not None
        ctx.sinks_shape = None if sinks is None else sinks.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        q, k, v, _, _ = ctx.saved_tensors
        sinks = grad.new_empty(ctx.sinks_shape) if ctx.with_sinks else None
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), sinks


def flex_footprint(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None,
                   sinks: Tensor | None = None) -> Tensor:  # fmt: skip
    """The plan's stand-in for flex attention (an `AttentionFn`)."""
    return _FusedKernelFootprint.apply(q, k, v, sinks)  # type: ignore[no-any-return]


class _ContextFootprint(ContextAttention):
    """`ContextAttention` whose kernel is the stand-in: the row's keys and values are gathered as in the run."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None,
                 sinks: Tensor | None = None) -> Tensor:  # fmt: skip
        kv = gather_row(torch.cat([k, padded_values(v, k.shape[-1])], dim=1), self.shard)
        keys, values = kv.split([k.shape[1], k.shape[1]], dim=1)
        return flex_footprint(q, keys, values[..., : v.shape[-1]], mask, window, sinks)


def stand_in_for_flex(model: CausalLM) -> bool:
    """Trace `model`'s flex attention (with or without context parallelism) as `flex_footprint`; returns whether
    its attention was flex attention."""
    decoder = model.model
    attention = decoder.attention
    if isinstance(attention, ContextAttention) and attention.shard.kernel == "flex":
        decoder.use_attention(_ContextFootprint(attention.shard), decoder.row_split)
        return True
    if attention is flex_attention_fn:
        decoder.use_attention(flex_footprint)
        return True
    return False
