"""Grouped matmul for routed experts: `torch._grouped_mm`, traceable by torch.compile in every dtype.

`torch._grouped_mm(a [M, K], b [E, K, N], offs)` multiplies the rows of each group (group g ends at offs[g]) by its
own matrix. Eagerly it computes any dtype on any device: CUDA's fast kernel for bf16 on sm90+ (no host sync), a
per-group fallback otherwise. torch's fake (meta) kernel, which torch.compile traces with, accepts bf16 only, so
other dtypes go through the custom ops below: the same eager kernels, a fake kernel without the dtype check, and a
backward made of grouped matmuls.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """a [M, K] (rows sorted by group), b [E, K, N], int32 offs [E] (group end rows) -> [M, N]."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_any(a, b, offs)


@torch.library.custom_op("lmforge::grouped_mm", mutates_args=())
def _grouped_mm_any(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_any.register_fake
def _grouped_mm_fake(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("lmforge::grouped_mm_weight_grad", mutates_args=())
def _weight_grad(a: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
    # Group g contributes a[rows of g].T @ grad[rows of g]: a 2-D x 2-D grouped matmul over the shared M dim.
    return torch._grouped_mm(a.t(), grad, offs=offs)


@_weight_grad.register_fake
def _weight_grad_fake(a: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(offs.shape[0], a.shape[1], grad.shape[1])


def _setup_context(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor
) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    a, b, offs = ctx.saved_tensors
    # _grouped_mm wants 16-byte aligned strides; a gradient can arrive expanded (stride 0).
    grad = grad.contiguous()
    grad_a = _grouped_mm_any(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = _weight_grad(a, grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_grouped_mm_any.register_autograd(_backward, setup_context=_setup_context)
