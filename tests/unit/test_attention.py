"""Every attention backend honours segments: a packed row equals each segment run alone."""

from __future__ import annotations

import pytest
import torch

from lmforge.model.attention import (
    CPU_MASK_AREA_PER_CALL,
    DocumentMask,
    backend_available,
    choose_backend,
    equal_length_runs,
    get_attention,
    resolve_backend,
)

DOC_LENS = [5, 17, 1, 30, 11]


def _qkv(total: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(total, hq, d), (total, hkv, d), (total, hkv, d)]
    return [torch.randn(s, generator=g, dtype=torch.float32).to(device, dtype).requires_grad_(grad) for s in shapes]


def _per_segment(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    fn = get_attention(name)
    outs = []
    for qs, ks, vs in zip(q.split(DOC_LENS), k.split(DOC_LENS), v.split(DOC_LENS), strict=True):
        mask = DocumentMask.from_doc_lens(torch.tensor([qs.shape[0]], dtype=torch.int32), q.device)
        outs.append(fn(qs, ks, vs, mask))
    return torch.cat(outs)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: list[int]) -> torch.Tensor:
    """Independent math: softmax attention per segment with an explicit causal mask, kv heads repeated."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(doc_lens), k.split(doc_lens), v.split(doc_lens), strict=True):
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        scores = torch.einsum("thd,shd->hts", qs, ks) / qs.shape[-1] ** 0.5
        n = qs.shape[0]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vs))
    return torch.cat(outs)


def _check(name: str, device: str, dtype: torch.dtype, atol: float, backward: bool) -> None:
    total = sum(DOC_LENS)
    q, k, v = _qkv(total, 4, 2, 16, dtype, device, grad=backward)
    packed = get_attention(name)(q, k, v, DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), q.device))
    alone = _per_segment(name, q, k, v)
    torch.testing.assert_close(packed, alone, atol=atol, rtol=0)
    expected = reference(q.float(), k.float(), v.float(), DOC_LENS)
    torch.testing.assert_close(packed.float(), expected, atol=atol * 10, rtol=0)
    if not backward:
        return
    grad_out = torch.randn_like(packed)
    g_packed = torch.autograd.grad(packed, (q, k, v), grad_out)
    g_alone = torch.autograd.grad(alone, (q, k, v), grad_out)
    for a, b in zip(g_packed, g_alone, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["sdpa", "sdpa_loop", "auto"])
def test_cpu_backends_forward_and_backward(name: str) -> None:
    _check(name, "cpu", torch.float32, atol=1e-5, backward=True)


def test_auto_is_exact_past_the_switch_point(monkeypatch: pytest.MonkeyPatch) -> None:
    # With more segments than the switch point, auto runs the masked kernel: still packed == per segment.
    lens = [3, 1, 7, 2, 5] * 4
    assert len(equal_length_runs(lens)) * CPU_MASK_AREA_PER_CALL > sum(lens) ** 2
    assert choose_backend(lens, torch.device("cpu")) == "sdpa"
    monkeypatch.setattr(f"{__name__}.DOC_LENS", lens)
    _check("auto", "cpu", torch.float32, atol=1e-5, backward=True)


def test_flex_forward_on_cpu() -> None:
    # flex attention has no CPU backward; its forward (the same block mask as on CUDA) is checked here.
    _check("flex", "cpu", torch.float32, atol=1e-5, backward=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "varlen", "flex", "sdpa", "sdpa_loop", "auto"])
def test_cuda_backends_bf16(name: str) -> None:
    if not backend_available(name, torch.device("cuda")):
        pytest.skip(f"{name} not available here")
    _check(name, "cuda", torch.bfloat16, atol=2e-2, backward=True)


def test_auto_resolves_to_a_backend_that_trains_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "auto"  # chosen per row
    assert resolve_backend("auto", cpu, compiled=True) == "auto"  # runs eagerly between compiled graphs
    with pytest.raises(ValueError, match="cannot train on cpu"):
        resolve_backend("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("causal", torch.device("cpu"))


def test_segments_do_not_see_each_other() -> None:
    # Changing the first segment's values must leave the second segment's outputs untouched.
    q, k, v = (torch.randn(8, 2, 4) for _ in range(3))
    mask = DocumentMask.from_doc_lens(torch.tensor([3, 5]), torch.device("cpu"))
    before = get_attention("sdpa")(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[:3] += 10.0
    v2[:3] -= 10.0
    after = get_attention("sdpa")(q, k2, v2, mask)
    torch.testing.assert_close(after[3:], before[3:])
    assert not torch.allclose(after[:3], before[:3])


def test_auto_picks_per_segment_sdpa_for_few_segments_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert choose_backend([512], cpu) == "sdpa_loop"
    # The loop costs about one fixed share per kernel call, one per run of equal-length neighbours.
    varied = [10, 22] * 5 + [12, 24] * 3  # T = 268 in 16 calls: past the switch point (~13)
    assert choose_backend(varied, cpu) == "sdpa"
    assert choose_backend([10, 22] * 5 + [96], cpu) == "sdpa_loop"  # 11 calls
    assert choose_backend([16] * 16, cpu) == "sdpa_loop"  # the same 16 segments with one length: one call
    assert choose_backend([1] * 1024, cpu) == "sdpa_loop"
    assert choose_backend([3, 5] * 128, cpu) == "sdpa"  # T = 1024 in 256 calls (the switch is at ~190)
    assert choose_backend([3, 5] * 64 + [512], cpu) == "sdpa_loop"  # 129 calls
    # The choice is made once per row and shared by every layer of the forward pass.
    q, k, v = _qkv(512, 4, 2, 16, torch.float32, "cpu", grad=False)
    mask = DocumentMask.from_doc_lens(torch.tensor([512]), q.device)
    get_attention("auto")(q, k, v, mask)
    assert mask.cache == {"auto": "sdpa_loop"}  # no dense [T, T] mask was built


def test_sdpa_loop_batches_runs_of_equal_length_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs of equal-length segments go through one batched call each; outputs and gradients stay per segment.
    lens = [6, 6, 6, 2, 9, 9, 1]
    assert equal_length_runs(lens) == [(6, 3), (2, 1), (9, 2), (1, 1)]
    monkeypatch.setattr(f"{__name__}.DOC_LENS", lens)
    _check("sdpa_loop", "cpu", torch.float32, atol=1e-5, backward=True)


def test_auto_on_cuda_without_varlen_runs_equal_segments_as_one_causal_call() -> None:
    cuda = torch.device("cuda")  # only the choice is checked: no CUDA needed
    assert choose_backend([4096], cuda) == "sdpa_loop"
    assert choose_backend([512] * 8, cuda) == "sdpa_loop"  # whole windows, no document masking
    assert choose_backend([512, 300, 212], cuda) == "flex"
