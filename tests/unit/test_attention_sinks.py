"""Attention sinks: every backend that takes them equals a float64 reference written from the definition (the
sink's exp in each query's softmax denominator, nothing in its numerator), forward and backward (the sinks'
gradient too), with and without sliding windows, under context parallelism; the varlen kernels refuse them."""

from __future__ import annotations

import pytest
import torch

from lmforge.model.attention import DocumentMask, get_attention
from lmforge.parallel.context import ContextShard, attend_gathered
from tests.unit.test_sliding_window import DOC_LENS, HKV, HQ, T, _inputs

CPU = torch.device("cpu")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None
) -> torch.Tensor:
    """out_i = sum_j exp(x_ij) v_j / (sum_j exp(x_ij) + exp(s_h)) over the keys j query i may attend (same document,
    j <= i, i - j < window), with x = q.k / sqrt(D), one head at a time, in float64."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    starts = [sum(DOC_LENS[:n]) for n in range(len(DOC_LENS))]
    groups = HQ // HKV
    for start, n in zip(starts, DOC_LENS, strict=True):
        for i in range(start, start + n):
            lo = start if window is None else max(start, i - window + 1)
            for h in range(HQ):
                x = (k[lo : i + 1, h // groups] @ q[i, h]) / q.shape[-1] ** 0.5
                weights = x.exp() / (x.exp().sum() + sinks[h].exp())
                out[i, h] = weights @ v[lo : i + 1, h // groups]
    return out


def _sinks() -> torch.Tensor:
    return torch.tensor([-1.0, 0.5, 2.0, 4.0], dtype=torch.float64)  # from negligible to most of the attention


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", ["sdpa_loop", "sdpa", "auto", "flex"])
def test_cpu_backends_equal_the_definition(backend: str, window: int | None) -> None:
    q, k, v, grad = _inputs()
    backward = backend != "flex"  # flex attention has no backward on the CPU
    ours_in = [x.clone().requires_grad_(backward) for x in (q, k, v, _sinks())]
    ref_in = [x.clone().requires_grad_() for x in (q, k, v, _sinks())]
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), CPU)
    ours = get_attention(backend)(*ours_in[:3], mask, window, ours_in[3])
    ref = reference(*ref_in[:3], ref_in[3], window)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    if backward:
        ours.backward(grad)
        ref.backward(grad)
        for name, mine, theirs in zip("qkvs", ours_in, ref_in, strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-10, rtol=0, msg=name)
    # The sinks take a visible share of the attention: without them the output differs.
    plain = get_attention("sdpa")(q, k, v, mask, window)
    assert (ref.detach() - plain).abs().max() > 1e-2


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_each_cp_ranks_part_equals_the_definition(kernel: str) -> None:
    q, k, v, grad = _inputs()
    backward = kernel != "flex"
    ref_in = [x.clone().requires_grad_() for x in (q, k, v, _sinks())]
    ref = reference(*ref_in[:3], ref_in[3], 4)
    ref.backward(grad)
    size = 2
    sinks = _sinks().requires_grad_(backward)
    for rank in range(size):
        shard = ContextShard(None, rank, size, kernel)
        index, gathered = shard.index(T), shard.gathered_index(T)
        local_q = q[index].clone().requires_grad_(backward)
        kv = torch.cat([k, v], dim=1)[gathered].clone()
        mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), CPU)
        out = attend_gathered(local_q, kv, HKV, mask, shard, 4, sinks)
        torch.testing.assert_close(out, ref[index].detach(), atol=1e-10, rtol=0)
        if backward:
            out.backward(grad[index])
            torch.testing.assert_close(local_q.grad, ref_in[0].grad[index], atol=1e-10, rtol=0)
    if backward:  # each rank's queries add their share of the sinks' gradient
        torch.testing.assert_close(sinks.grad, ref_in[3].grad, atol=1e-10, rtol=0)


def test_varlen_kernels_refuse_sinks() -> None:
    q, k, v, _ = _inputs()
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), CPU)
    for backend in ("flash", "varlen"):
        with pytest.raises(ValueError, match=f"model.attn = '{backend}' cannot compute attention sinks"):
            get_attention(backend)(q, k, v, mask, None, _sinks())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "sdpa_loop", "sdpa"])
def test_cuda_backends_equal_the_definition(backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = torch.device("cuda")
    q, k, v, grad = _inputs(torch.bfloat16, cuda)
    ours_in = [x.clone().requires_grad_() for x in (q, k, v, _sinks().float().to(cuda))]
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), cuda)
    ours = get_attention(backend)(*ours_in[:3], mask, 4, ours_in[3])
    ours.backward(grad)
    ref_in = [x.detach().cpu().double().requires_grad_() for x in ours_in]
    ref = reference(*ref_in[:3], ref_in[3], 4)
    ref.backward(grad.cpu().double())
    torch.testing.assert_close(ours.double().cpu(), ref, atol=2e-2, rtol=0)
    for mine, theirs in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(mine.grad.double().cpu(), theirs.grad, atol=5e-2, rtol=0)


def test_sinks_with_value_heads_narrower_than_query_heads() -> None:
    q, k, v, grad = _inputs()
    v, grad = v[..., :5].clone(), grad[..., :5].clone()
    for backend in ("sdpa_loop", "sdpa"):
        ours_in = [x.clone().requires_grad_() for x in (q, k, v, _sinks())]
        ref_in = [x.clone().requires_grad_() for x in (q, k, v, _sinks())]
        mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), CPU)
        ours = get_attention(backend)(*ours_in[:3], mask, 4, ours_in[3])
        ref = reference(*ref_in[:3], ref_in[3], 4)
        torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
        ours.backward(grad)
        ref.backward(grad)
        for mine, theirs in zip(ours_in, ref_in, strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-10, rtol=0)
