"""Auxiliary losses that train through their gradient alone: the forward value stays the main one (the block output,
or the main loss), so what the loop logs and sums is unchanged, and backward gives the auxiliary loss a gradient
set per step. The MoE's sequence-wise balance loss and multi-token prediction's depths enter training this way."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _AuxLossGradient(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` gets the gradient `scale` (its shape), whatever reaches `out`."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.reshape(ctx.aux_shape).to(torch.float32), None


def with_aux_gradient(out: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
    """`out`, through which backward also reaches `aux` with the gradient `scale` (a device tensor set per step)."""
    return _AuxLossGradient.apply(out, aux, scale)  # type: ignore[no-any-return]
