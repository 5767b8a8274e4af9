"""RMSNorm and RoPE with hand-written backwards: the same function and gradients as the autograd formulas."""

from __future__ import annotations

import pytest
import torch

from lmforge.model.norm import RMSNorm, RMSNormFunction
from lmforge.model.rotary import RotaryFunction, apply_rotary, rotary_cos_sin
from tests.conftest import tiny_llama


def autograd_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, left to autograd."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def autograd_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE over the leading cos.shape[-1] channels, left to autograd."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = cos.shape[-1]
    turned, kept = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, kept), dim=-1)


def test_rms_norm_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(8, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64, 32), (16, 4, 32), (2, 16, 32)])
def test_rms_norm_matches_autograd(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=dtype) * 3
    w = 1 + 0.1 * torch.randn(shape[-1], generator=g, dtype=dtype)
    grad_out = torch.randn(shape, generator=g, dtype=dtype)
    x1, w1, x2, w2 = (t.clone().requires_grad_() for t in (x, w, x, w))
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    out = RMSNormFunction.apply(x1, w1, 1e-5)
    ref = autograd_rms_norm(x2, w2, 1e-5)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-10}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(norm(x), ref.detach(), **tol)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    torch.testing.assert_close(w1.grad, w2.grad, atol=tol["atol"] * shape[0] * 10, rtol=tol["rtol"] * 10)


def test_rms_norm_in_bf16_keeps_hf_rounding() -> None:
    # bf16 activations and weight (FSDP's mixed precision): normalized in fp32, cast to bf16, then scaled.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    grad_out = torch.randn(32, 64, generator=g).bfloat16()
    x1, w1, x2, w2 = (t.clone().requires_grad_() for t in (x, w, x, w))
    out, ref = RMSNormFunction.apply(x1, w1, 1e-5), autograd_rms_norm(x2, w2, 1e-5)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    out.backward(grad_out)
    ref.backward(grad_out)
    assert x1.grad is not None and x1.grad.dtype == torch.bfloat16 and w1.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w1.grad, w2.grad, atol=5e-2, rtol=2e-2)


def test_rms_norm_without_weight_gradient() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8)
    RMSNormFunction.apply(x, w, 1e-5).sum().backward()
    assert x.grad is not None and w.grad is None


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_rotary_gradients_pass_gradcheck(scaling: dict[str, object] | None) -> None:
    # YaRN scales both tables (a scaled rotation), which the hand-written backward must still transpose.
    arch = tiny_llama(head_dim=8, rope_theta=100.0, rope_scaling=scaling)
    cos, sin = rotary_cos_sin(torch.arange(6), arch, torch.float64)
    if scaling:
        assert (cos.square() + sin.square() - 1).abs().min() > 0.01  # the tables are scaled
    x = torch.randn(6, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: RotaryFunction.apply(a, cos[:, None], sin[:, None]), (x,))


@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial RoPE
def test_rotary_matches_autograd(rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(3)
    positions = torch.cat([torch.arange(20), torch.arange(12)])  # two segments: positions restart
    cos, sin = rotary_cos_sin(positions, tiny_llama(head_dim=rotary_dim), torch.float32)
    x = torch.randn(32, 4, 32, generator=g)
    grad_out = torch.randn(32, 4, 32, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = apply_rotary(x1, cos, sin), autograd_rotary(x2, cos, sin)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-6)
    # The rotation keeps each pair's norm: a check that does not depend on the reference's formula.
    pairs = rotary_dim // 2
    before = x[..., :pairs].square() + x[..., pairs:rotary_dim].square()
    after = out.detach()[..., :pairs].square() + out.detach()[..., pairs:rotary_dim].square()
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.detach()[..., rotary_dim:], x[..., rotary_dim:])
