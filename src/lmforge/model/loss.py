"""The LM head and cross-entropy, plain or in token chunks that never hold the full [tokens, vocab] logits.

With a vocabulary of 128k and 16k tokens per micro-batch, fp32 logits alone take 8 GiB, plus as much again for
their gradient. The chunked path computes, for `chunk` tokens at a time, the fp32 logits, their cross-entropy and
(in backward, recomputed) their gradient, so the peak is chunk x vocab; it returns the same loss sum and the same
gradients for the hidden states and the head's weight as the plain path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
"""Target id of a position that is not a loss token."""


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum over loss tokens of cross_entropy(hidden @ weight.T, targets), chunk by chunk, in fp32."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        w = weight.float()
        for start in range(0, hidden.shape[0], chunk):
            logits = hidden[start : start + chunk].float() @ w.T
            t = targets[start : start + chunk]
            total = total + F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        w = weight.float()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(w)
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk].float()
            t = targets[start : start + ctx.chunk]
            # d(sum CE)/d(logits) = softmax - one_hot(target), zero on ignored positions.
            grad_logits = torch.softmax(h @ w.T, dim=-1)
            keep = t != IGNORE_INDEX
            rows = torch.arange(t.shape[0], device=t.device)
            grad_logits[rows[keep], t[keep]] -= 1.0
            grad_logits *= keep.unsqueeze(1) * grad_out
            grad_hidden[start : start + ctx.chunk] = (grad_logits @ w).to(hidden.dtype)
            grad_weight += grad_logits.T @ h
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def head_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 0) -> Tensor:
    """fp32 sum of the cross-entropy of `hidden` [T, H] through the LM head `weight` [V, H] against `targets` [T]
    (IGNORE_INDEX where no loss); in chunks of `chunk_tokens` tokens when > 0, else with the full logits."""
    if chunk_tokens > 0:
        return _ChunkedHeadCrossEntropy.apply(hidden, weight, targets, chunk_tokens)
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def head_token_losses(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """fp32 cross-entropy of every position [T] (0 where the target is IGNORE_INDEX): the LM head and the softmax
    in fp32, `chunk_tokens` positions at a time, never holding the full logits. For scoring, without gradients."""
    out = torch.zeros(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    w = weight.float()
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        logits = hidden[part].float() @ w.T
        out[part] = F.cross_entropy(logits, targets[part], ignore_index=IGNORE_INDEX, reduction="none")
    return out
