"""The LM head and cross-entropy, plain or in token chunks that never hold the full [tokens, vocab] logits.

With a vocabulary of 128k and 16k tokens per micro-batch, fp32 logits alone take 8 GiB, plus as much again for
their gradient. The chunked path computes, for `chunk` tokens at a time, the logits (the matmul in the weights'
dtype, as `F.linear` does, then fp32), their cross-entropy and at once their gradient, which it turns into the
gradients of the hidden states and of the head's weight before the next chunk. So the peak is chunk x vocab, no
matmul is recomputed in backward (the backward only scales the stored gradients by the upstream one), and the
softmax is computed once instead of three passes over the full logits (log-softmax, its backward, the NLL's
backward). Loss and gradients equal the plain path's up to rounding. Nothing in it reads a value back to the
host.

With a z-loss coefficient c > 0 (`model.z_loss`; PaLM, arXiv:2204.02311, section 5), each path also sums lse^2 over
the loss tokens, lse the log-sum-exp of the token's logits, and its gradient is that of CE + c x sum lse^2 while the
value it returns stays the cross-entropy: the chunked path adds d(c lse^2)/d(logits) = 2 c lse softmax to the
gradient it forms anyway, the plain path takes it through autograd.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lmforge.model.vocab_parallel import VocabShard

IGNORE_INDEX = -100
"""Target id of a position that is not a loss token."""

CPU_LOSS_CHUNK_TOKENS = 512
"""`loss_chunk_tokens = "auto"` on the CPU. With vocabulary 8192 and 4096 tokens, loss and gradients took 305 ms
against 294 ms for the full logits when freed memory is kept (as CPU runs do, `lmforge.train.host_memory`), and
337 against 434 ms when it is not; chunks of 256-2048 tokens were within 3% of each other. Kept for the memory: a
chunk's logits instead of all of them, with their gradient."""


def resolve_loss_chunk(setting: int | Literal["auto"], device: torch.device) -> int:
    """The chunk size `model.loss_chunk_tokens` means on `device`: `auto` is `CPU_LOSS_CHUNK_TOKENS` on the CPU and
    0 (the full logits) elsewhere, where the chunked path has not been timed yet."""
    if setting != "auto":
        return setting
    return CPU_LOSS_CHUNK_TOKENS if device.type == "cpu" else 0


def _chunk_loss(
    logits: Tensor, targets: Tensor, shard: VocabShard | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fp32 cross-entropy of each position of one chunk (0 where ignored), and what its gradient needs: the
    softmax (made in place in `logits`, whose values are gone after the call), the targets made safe to gather (0
    where ignored or, under a vocabulary `shard`, another rank's), where this rank holds the target's logit, the
    keep mask, and each position's log-sum-exp (the z-loss's). In place, because on the CPU every new
    [chunk, vocab] buffer costs page faults.

    With `shard`, `logits` are this rank's columns: the row maxima, then the exponential sums and target logits,
    are all-reduced over the group (two collectives), so the loss is the whole vocabulary's on every rank."""
    keep = targets != IGNORE_INDEX
    local = targets if shard is None else targets - shard.start
    mine = keep if shard is None else keep & (local >= 0) & (local < logits.shape[1])
    safe = torch.where(mine, local, 0).unsqueeze(1)
    picked = logits.gather(1, safe).squeeze(1)
    top = logits.amax(dim=-1, keepdim=True)
    if shard is not None:
        picked = torch.where(mine, picked, 0.0)
        dist.all_reduce(top, dist.ReduceOp.MAX, group=shard.group)
    total = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
    if shard is not None:
        both = torch.cat([total, picked.unsqueeze(1)], dim=1)
        dist.all_reduce(both, group=shard.group)
        total, picked = both[:, :1], both[:, 1]
    lse = (top + total.log()).squeeze(1)
    return (lse - picked) * keep, logits.div_(total), safe, mine, keep, lse


class _FusedHeadCrossEntropy(torch.autograd.Function):
    """sum over loss tokens of cross_entropy(hidden @ weight.T, targets), chunk by chunk, gradients taken in
    forward. Under a vocabulary shard, `weight` is this rank's rows of the head and the hidden states' gradient is
    this rank's partial sum. With `z_loss` > 0 it returns the sum of lse^2 over the loss tokens too (no gradient
    flows into it): the gradient of the first output is that of CE + z_loss x that sum."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk: int,
        shard: VocabShard | None = None,
        z_loss: float = 0.0,
    ) -> Tensor | tuple[Tensor, Tensor]:
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        z_total = torch.zeros((), device=hidden.device, dtype=torch.float32) if z_loss > 0 else None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            logits = (h @ weight.T).float()
            losses, grad, safe, mine, keep, lse = _chunk_loss(logits, targets[start : start + chunk], shard)
            total += losses.sum()
            if z_total is not None:
                # d(z_loss lse^2)/d(logits) = 2 z_loss lse softmax: the softmax rows scaled before the one-hot goes
                # in. Ignored rows take lse 0, so that a non-finite one there reaches neither the sum nor the
                # gradient.
                lse = torch.where(keep, lse, 0.0)
                z_total += lse.square().sum()
                grad.mul_(lse.mul(2 * z_loss).add_(1).unsqueeze(1))
            # d(sum CE)/d(logits) = softmax - one_hot(target), zero on ignored rows; made in place in the logits.
            grad.scatter_add_(1, safe, mine.unsqueeze(1).to(grad.dtype).neg())
            grad = grad.mul_(keep.unsqueeze(1)).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = grad @ weight
            if grad_weight is not None:
                if grad.dtype == torch.float32:
                    grad_weight.addmm_(grad.T, h)
                else:
                    grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        if z_total is None:
            return total
        ctx.mark_non_differentiable(z_total)
        return total, z_total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_z_grad: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None


class _TrainedWith(torch.autograd.Function):
    """Identity on `out`; backward also passes `extra` the upstream gradient times `coeff`. What is reported is
    `out`, what is trained is `out + coeff * extra`, and the reported value is `out` bit for bit (adding and
    subtracting the extra term would round it, or turn it NaN with an infinite extra term)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, extra: Tensor, coeff: float) -> Tensor:
        ctx.coeff = coeff
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, grad * ctx.coeff, None


def head_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_tokens: int = 0,
    shard: VocabShard | None = None,
    z_loss: float = 0.0,
) -> Tensor:
    """fp32 sum of the cross-entropy of `hidden` [T, H] through the LM head `weight` [V, H] against `targets` [T]
    (IGNORE_INDEX where no loss); in chunks of `chunk_tokens` tokens when > 0, else with the full logits. Under a
    vocabulary `shard`, `weight` holds this rank's rows and the logits are never gathered (one chunk of all T
    tokens when `chunk_tokens` is 0). With `z_loss` > 0 its gradient is that of CE + z_loss x the sum of lse^2
    over the loss tokens (`head_losses`, which also returns that sum)."""
    return head_losses(hidden, weight, targets, chunk_tokens, shard, z_loss)[0]


def head_losses(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_tokens: int = 0,
    shard: VocabShard | None = None,
    z_loss: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """`head_cross_entropy`'s fp32 cross-entropy sum, and with `z_loss` > 0 the fp32 sum of lse^2 over the loss
    tokens (detached; None when `z_loss` is 0). The first's gradient is that of CE + z_loss x the second, its value
    the cross-entropy alone. Under a vocabulary `shard`, lse is the whole vocabulary's on every rank."""
    if chunk_tokens <= 0 and shard is None:
        logits = F.linear(hidden, weight)
        ce = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        if z_loss <= 0:
            return ce, None
        lse = torch.logsumexp(logits.float(), dim=-1)
        z = torch.where(targets != IGNORE_INDEX, lse, 0.0).square().sum()
        return _TrainedWith.apply(ce, z, z_loss), z.detach()
    chunk = chunk_tokens if chunk_tokens > 0 else max(hidden.shape[0], 1)
    if z_loss > 0:
        # Without gradients too: the z sum is the training path's (the matmul in the weights' dtype).
        ce, z = _FusedHeadCrossEntropy.apply(hidden, weight, targets, chunk, shard, z_loss)
        return ce, z
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedHeadCrossEntropy.apply(hidden, weight, targets, chunk, shard), None
    # Without gradients (scoring), the head runs in fp32, as validation's figures are defined.
    return head_token_losses(hidden, weight, targets, chunk, shard).sum(), None


@torch.no_grad()
def head_token_losses(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, shard: VocabShard | None = None
) -> Tensor:
    """fp32 cross-entropy of every position [T] (0 where the target is IGNORE_INDEX): the LM head and the softmax
    in fp32, `chunk_tokens` positions at a time, never holding the full logits. For scoring, without gradients.
    Under a vocabulary `shard`, `weight` holds this rank's rows and every rank gets the whole vocabulary's losses."""
    out = torch.zeros(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    w = weight.float()
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        logits = hidden[part].float() @ w.T
        if shard is None:
            out[part] = F.cross_entropy(logits, targets[part], ignore_index=IGNORE_INDEX, reduction="none")
        else:
            out[part] = _chunk_loss(logits, targets[part], shard)[0]
    return out
