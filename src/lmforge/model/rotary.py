"""Rotary position embeddings (RoPE) in HF's half-split layout, with a hand-written backward.

A head's channels are two halves (x1, x2) turned by the angle of the token's position:
`out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = (-x2, x1)`. Left to autograd, the rotation's backward
runs the slices' backward (zero-filled copies) and a concatenation's; but the rotation is orthogonal, so its
gradient is the same rotation by the opposite angle, `grad_x = g * cos - rotate_half(g) * sin`, which
`RotaryFunction` computes in the forward's three passes. That identity needs cos and sin equal on both halves, which
`rotary_cos_sin` guarantees (its tables are the frequencies twice over). YaRN scales both tables by one factor,
which leaves the identity intact: the transpose of a scaled rotation is the opposite rotation scaled alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lmforge.config.arch import AnyArch
from lmforge.model.rope_scaling import rotary_frequencies


def rotary_cos_sin(position_ids: Tensor, arch: AnyArch, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables [T, arch.rotary_dim] for the given positions (HF's half-split layout, computed in fp32),
    with the architecture's RoPE scaling (and, for YaRN, its attention factor on both tables)."""
    inv_freq, attention_factor = rotary_frequencies(arch, position_ids.device)
    freqs = position_ids.reshape(-1).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def _turn(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    """x * cos + rotate_half(x) * sin, or with `backward` the opposite turn x * cos - rotate_half(x) * sin.

    rotate_half(x) * sin = swap_halves(x) * (-sin1, sin1) for sin = (sin1, sin1): one concatenation of the halves
    and one fused multiply-add instead of slices, a negation and a concatenation. (A `flip` of the halves moves the
    same data at twice the cost on the CPU: 51 against 25 us for a [1024, 4, 64] input on 2 threads.)"""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    # Built from the table itself (a [T, 1, D] tensor, small beside x): a constant copied to the device per call
    # would make the host wait for it.
    first = sin[..., :half]
    signed = torch.cat((-first, first), dim=-1)
    return torch.addcmul(x * cos, swapped, signed, value=-1 if backward else 1)


class RotaryFunction(torch.autograd.Function):
    """x [..., D] turned by cos and sin [..., D] (broadcast to x; both halves of each equal)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _turn(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _turn(grad_out, cos, sin, backward=True), None, None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] by the position tables [T, rotary_dim] of `rotary_cos_sin`: the leading
    rotary_dim channels of each head turn, the rest pass through (partial RoPE, as transformers' GLM-4.5). The
    tables carry no gradient."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return RotaryFunction.apply(x, cos, sin)  # type: ignore[no-any-return]
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((RotaryFunction.apply(turned, cos, sin), kept), dim=-1)
