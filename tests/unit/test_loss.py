"""The chunked LM head + cross-entropy gives the plain path's loss and gradients; what `auto` chunks mean."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.batch import positions_from_doc_lens
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.loss import CPU_LOSS_CHUNK_TOKENS, IGNORE_INDEX, head_cross_entropy, resolve_loss_chunk
from tests.conftest import tiny_llama


@pytest.mark.parametrize("chunk", [1, 7, 32, 100])
def test_chunked_head_loss_and_gradients_equal_the_plain_path(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, dtype=torch.float64).float()
    weight = torch.randn(300, 16, generator=g) * 0.3
    targets = torch.randint(0, 300, (50,), generator=g)
    targets[::4] = IGNORE_INDEX
    results = []
    for size in (0, chunk):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = head_cross_entropy(h, w, targets, size)
        (loss * 0.37).backward()  # an upstream gradient other than 1
        results.append((loss.detach(), h.grad, w.grad))
    (loss_a, gh_a, gw_a), (loss_b, gh_b, gw_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh_b, gh_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw_b, gw_a, rtol=1e-5, atol=1e-6)
    assert gh_a[::4].abs().max() == 0 and gh_b[::4].abs().max() == 0  # ignored positions get no gradient


def test_model_loss_with_chunks_equals_the_logits_path(one_thread: None) -> None:
    model = build_model(tiny_llama(), 256, "sdpa", torch.device("cpu"))
    init_weights(model, 0.05, seed=1)
    lens = torch.tensor([20, 44], dtype=torch.int32)
    ids = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(2))
    positions = torch.from_numpy(positions_from_doc_lens(lens.numpy()))[None]
    targets = ids[:, 1:].clone()
    targets[0, 19] = IGNORE_INDEX  # the last token of a document predicts nothing
    grads = []
    for chunk in (0, 16):
        model.zero_grad()
        model.loss_chunk_tokens = chunk
        loss = model(ids[:, :-1], positions, lens, targets=targets)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    reference = torch.nn.functional.cross_entropy(
        model(ids[:, :-1], positions, lens)[0].float(), targets[0], ignore_index=IGNORE_INDEX, reduction="sum"
    )
    torch.testing.assert_close(grads[0][0], reference.detach())
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-5)
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _plain_and_chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                       grads: tuple[bool, bool]) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
    results = []
    for size in (0, chunk):
        h, w = hidden.clone().requires_grad_(grads[0]), weight.clone().requires_grad_(grads[1])
        loss = head_cross_entropy(h, w, targets, size)
        (loss * 1.7).backward()
        results.append((loss.detach(), h.grad, w.grad))
    return results


def test_chunked_loss_in_bfloat16_is_as_close_to_exact_as_the_plain_path() -> None:
    """bf16 weights: the chunk's matmul runs in bf16 like `F.linear`, the softmax in fp32, and the weight's gradient
    is summed over chunks in fp32. Against the fp64 result of the same inputs, the chunked loss and gradients are
    no further off than the plain path's."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 32, generator=g).bfloat16()
    weight = (torch.randn(500, 32, generator=g) * 0.2).bfloat16()
    targets = torch.randint(0, 500, (64,), generator=g)
    targets[5:9] = IGNORE_INDEX
    (loss_a, gh_a, gw_a), (loss_b, gh_b, gw_b) = _plain_and_chunked(hidden, weight, targets, 24, (True, True))
    assert loss_b.dtype == torch.float32 and gh_b.dtype == gw_b.dtype == torch.bfloat16
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    exact = head_cross_entropy(h64, w64, targets, 0)
    (exact * 1.7).backward()
    for plain, chunked, ref in ((loss_a, loss_b, exact.detach()), (gh_a, gh_b, h64.grad), (gw_a, gw_b, w64.grad)):
        plain_err, chunked_err = (plain.double() - ref).abs().max(), (chunked.double() - ref).abs().max()
        assert chunked_err <= 1.5 * plain_err + 1e-6, (chunked_err, plain_err)
    assert gh_b[5:9].abs().max() == 0


@pytest.mark.parametrize("grads", [(True, False), (False, True)])
def test_chunked_loss_gives_only_the_gradients_asked_for(grads: tuple[bool, bool]) -> None:
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(30, 8, generator=g), torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (30,), generator=g)
    (_, gh_a, gw_a), (_, gh_b, gw_b) = _plain_and_chunked(hidden, weight, targets, 7, grads)
    for plain, chunked, asked in ((gh_a, gh_b, grads[0]), (gw_a, gw_b, grads[1])):
        assert (chunked is not None) == asked
        if asked:
            torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)


def test_chunked_loss_without_gradients_equals_the_plain_loss() -> None:
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(50, 16, generator=g), torch.randn(300, 16, generator=g)
    targets = torch.randint(0, 300, (50,), generator=g)
    targets[-3:] = IGNORE_INDEX
    with torch.no_grad():
        torch.testing.assert_close(
            head_cross_entropy(hidden, weight, targets, 16), head_cross_entropy(hidden, weight, targets, 0)
        )


def test_auto_chunk_is_the_measured_size_on_cpu_and_off_elsewhere() -> None:
    assert resolve_loss_chunk("auto", torch.device("cpu")) == CPU_LOSS_CHUNK_TOKENS
    assert resolve_loss_chunk("auto", torch.device("cuda")) == 0
    assert resolve_loss_chunk(64, torch.device("cuda")) == 64
    assert resolve_loss_chunk(0, torch.device("cpu")) == 0
