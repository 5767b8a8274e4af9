"""Sliding-window attention: every backend equals attention written from the definition (within each document,
each query attends the `window` keys ending at itself), forward and backward; Qwen3 / Qwen3-MoE windows give
transformers' logits and greedy tokens; the FLOP count of a windowed layer; config fields and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from lmforge.config.arch import AnyArch
from lmforge.config.hf_config import HFModelError, arch_to_hf_config, read_hf_config
from lmforge.model.attention import DocumentMask, get_attention
from lmforge.train.flops import FlopCounter, attended_pairs
from tests.conftest import require, tiny_llama, tiny_qwen3
from tests.unit.test_hf import VOCAB, _export, _from_pretrained, _ids, _lmforge, _logits, assert_documents_attend_alone
from tests.unit.test_moe import tiny_qwen3_moe
from tests.unit.test_rope_scaling import assert_greedy_equals_export

CPU = torch.device("cpu")
# Runs of equal lengths (batched kernel calls), documents shorter and longer than the windows below.
DOC_LENS = [3, 12, 12, 5, 20, 4]
T, HQ, HKV, D = sum(DOC_LENS), 4, 2, 8


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: list[int], window: int | None
) -> torch.Tensor:
    """Attention from the definition: query i of a document attends key j of the same document with
    i - window < j <= i (every j <= i without a window); query head h reads key/value head h // (HQ / HKV)."""
    allowed = torch.zeros(T, T, dtype=torch.bool)
    start = 0
    for n in doc_lens:
        for i in range(start, start + n):
            for j in range(start, i + 1):
                allowed[i, j] = window is None or i - j < window
        start += n
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, v)


def _inputs(dtype: torch.dtype = torch.float64, device: torch.device = CPU) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(T, h, D, generator=gen).to(device, dtype) for h in (HQ, HKV, HKV, HQ)]


def check_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                  window: int | None) -> torch.Tensor:  # fmt: skip
    """A CPU backend's output, and its q, k, v gradients (not flex's: it has no CPU backward), against
    `reference` in float64; returns the reference output."""
    backward = backend != "flex"
    ours_in = [x.clone().requires_grad_(backward) for x in (q, k, v)]
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), CPU)
    ours = get_attention(backend)(*ours_in, mask, window)
    ref = reference(*ref_in, DOC_LENS, window)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    if backward:
        ours.backward(grad)
        ref.backward(grad)
        for mine, theirs in zip(ours_in, ref_in, strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-10, rtol=0)
    return ref.detach()


@pytest.mark.parametrize("window", [1, 4, 12, 100])
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_loop", "auto", "flex"])
def test_cpu_backends_equal_the_definition(backend: str, window: int) -> None:
    q, k, v, grad = _inputs()
    ref = check_backend(backend, q, k, v, grad, window)
    # The window changes the result wherever a document is longer than it.
    if window < max(DOC_LENS):
        assert (ref - reference(q, k, v, DOC_LENS, None)).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "varlen", "flex", "sdpa_loop", "sdpa"])
def test_cuda_backends_equal_the_definition(backend: str) -> None:
    from lmforge.model.attention import backend_available

    cuda = torch.device("cuda")
    if not backend_available(backend, cuda):
        pytest.skip(f"{backend} not available here")
    q, k, v, grad = _inputs(torch.bfloat16, cuda)
    ours_in = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), cuda)
    ours = get_attention(backend)(*ours_in, mask, 6)
    ours.backward(grad)
    ref_in = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_in, DOC_LENS, 6)
    ref.backward(grad.cpu().double())
    torch.testing.assert_close(ours.double().cpu(), ref, atol=2e-2, rtol=0)
    for mine, theirs in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(mine.grad.double().cpu(), theirs.grad, atol=5e-2, rtol=0)


def test_windowed_pairs_count_the_mask() -> None:
    lens = torch.tensor(DOC_LENS, dtype=torch.int32)
    for window in (1, 4, 12, 100, None):
        dense = DocumentMask.from_doc_lens(lens, CPU)
        from lmforge.model.attention import dense_document_mask

        assert attended_pairs([lens], window) == int(dense_document_mask(dense, window).sum())
    # A model whose two layers have windows 4 and none counts their mean.
    model = torch.nn.Linear(4, 4)
    counter = FlopCounter(model, layers=2, heads=4, head_dim=8, windows=[4, None])
    assert counter.pairs([lens]) == (attended_pairs([lens], 4) + attended_pairs([lens])) / 2


ALTERNATING = {"use_sliding_window": True, "sliding_window": 5, "layer_types": ("sliding_attention", "full_attention")}


@pytest.mark.parametrize(
    "arch",
    [tiny_qwen3(**ALTERNATING), tiny_qwen3(use_sliding_window=True, sliding_window=7, max_window_layers=1),
     tiny_qwen3_moe(use_sliding_window=True, sliding_window=6)],
    ids=["qwen3-layer-types", "qwen3-max-window-layers", "qwen3-moe"],
)  # fmt: skip
def test_windows_give_transformers_logits_and_read_back(arch: AnyArch, tmp_path: Path) -> None:
    require("transformers")
    windows = [arch.attention_window(i) for i in range(arch.num_hidden_layers)]
    assert any(w is not None for w in windows)
    model = _lmforge(arch)
    _export(model, tmp_path)
    hf = _from_pretrained(tmp_path)
    ids = _ids(t=40)
    ours = _logits(model, ids, hf=False)
    torch.testing.assert_close(ours, _logits(hf, ids, hf=True), atol=1e-5, rtol=0)
    full = build_without_windows(model)
    assert (ours - _logits(full, ids, hf=False)).abs().max() > 1e-3, "the windows changed nothing"
    back = read_hf_config(tmp_path).arch
    assert [back.attention_window(i) for i in range(arch.num_hidden_layers)] == windows


def build_without_windows(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights with every block attending fully."""
    from lmforge.model import build_model

    full = build_model(model.arch.model_copy(update={"use_sliding_window": False, "layer_types": None}), VOCAB, "sdpa",
                       CPU)  # fmt: skip
    full.load_state_dict(model.state_dict())
    return full.eval()


def test_documents_do_not_share_a_window() -> None:
    # A query near a document's start sees only its own document's keys, however wide the window.
    assert_documents_attend_alone(_lmforge(tiny_qwen3(**ALTERNATING)))


def test_greedy_generation_with_windows_equals_transformers(tmp_path: Path, one_thread: object) -> None:
    require("transformers")
    assert_greedy_equals_export(tiny_qwen3(**ALTERNATING), tmp_path, 24)  # 32 positions: past the 5-key window


def test_window_fields_and_their_errors(tmp_path: Path) -> None:
    assert tiny_qwen3().attention_window(0) is None and tiny_llama().attention_window(1) is None
    arch = tiny_qwen3(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert [arch.attention_window(i) for i in range(2)] == [None, 64]  # transformers' rule
    with pytest.raises(ValidationError, match="layer_types has 1 entries for num_hidden_layers 2"):
        tiny_qwen3(use_sliding_window=True, layer_types=("full_attention",))
    with pytest.raises(ValidationError, match="use_sliding_window is false"):
        tiny_qwen3(layer_types=("sliding_attention", "full_attention"))
    config = arch_to_hf_config(tiny_qwen3(), VOCAB, bos_id=None, eos_id=None, pad_id=None, dtype="float32")
    for changes, match in [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "use_sliding_window is false"),
        (
            {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked_attention", "full_attention"]},
            "'chunked_attention'",
        ),
        ({"use_sliding_window": True, "sliding_window": None}, "sliding_window is None"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(HFModelError, match=match):
            read_hf_config(tmp_path)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_loop", "auto", "flex"])
def test_value_heads_narrower_than_query_heads(backend: str, window: int | None) -> None:
    # Multi-head latent attention's layout: 5-channel values under 8-channel queries and keys (the CPU kernel pads
    # them to 8 and cuts the output back).
    q, k, v, grad = _inputs()
    ref = check_backend(backend, q, k, v[..., :5].clone(), grad[..., :5].clone(), window)
    assert ref.shape == (T, HQ, 5)
