"""The chunked LM head + cross-entropy gives the plain path's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.batch import positions_from_seq_lens
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.loss import IGNORE_INDEX, head_cross_entropy
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
    positions = torch.from_numpy(positions_from_seq_lens(lens.numpy()))[None]
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
