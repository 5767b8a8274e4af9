"""The z-loss (`model.z_loss`): the LM head's plain, chunked and vocabulary-split paths train on CE + c x sum of
lse^2 while returning the cross-entropy; the step's gradient is that of mean CE + c x mean lse^2 over the global
batch's loss tokens; a run logs `loss/z` beside an unchanged `loss/mean`, skips a non-finite micro-batch whole, and
reads nothing more on the host."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import TrainConfig
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.loss import IGNORE_INDEX, head_cross_entropy, head_losses
from lmforge.monitor import read_metrics
from lmforge.parallel.process_group import DistContext, init_distributed
from lmforge.train.micro_batches import run_micro_batches
from lmforge.train.trainer import Trainer
from tests.conftest import tiny_llama
from tests.spawn import free_port, join_as_rank, run_ranks
from tests.unit.test_hf import _lmforge
from tests.unit.test_host_sync import _config as sync_config
from tests.unit.test_host_sync import expected_reads, run_checked
from tests.unit.test_micro_batches import make_batches, poisoned_vs_clean, train_config
from tests.unit.test_moe import tiny_deepseek
from tests.unit.test_mtp import DOCS, _row

CPU = torch.device("cpu")
COEFF = 0.05
"""Large enough that the z term moves the gradient far beyond the tolerances (2 c lse is about 0.6 here)."""


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CE sum, sum of lse^2 over the loss tokens, and CE + COEFF x that, by autograd through the full fp32 logits."""
    logits = hidden.float() @ weight.float().T
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    z = torch.logsumexp(logits, dim=-1)[targets != IGNORE_INDEX].square().sum()
    return ce, z, ce + COEFF * z


def head_inputs(seed: int = 0, tokens: int = 50, vocab: int = 300) -> tuple[torch.Tensor, ...]:
    """Hidden states, a head whose logits have a sizeable log-normalizer, and targets with every 4th ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 16, generator=g)
    weight = torch.randn(vocab, 16, generator=g) * 0.3
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::4] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [0, 1, 7, 32, 100])
def test_head_loss_trains_on_ce_plus_z_and_returns_the_ce(chunk: int) -> None:
    hidden, weight, targets = head_inputs()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ce_ref, z_ref, objective = reference(h_ref, w_ref, targets)
    (objective * 0.37).backward()  # an upstream gradient other than 1, as the step's 1 / loss tokens is
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ce, z = head_losses(h, w, targets, chunk, z_loss=COEFF)
    (ce * 0.37).backward()
    assert z is not None and not z.requires_grad
    torch.testing.assert_close(ce.detach(), ce_ref.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(z, z_ref.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    assert h.grad[::4].abs().max() == 0  # ignored positions get no gradient
    # The z term changes the gradient far beyond the tolerance, and leaves the returned loss bit for bit the CE's.
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ce0, z0 = head_losses(h0, w0, targets, chunk)
    (ce0 * 0.37).backward()
    assert z0 is None and torch.equal(ce0.detach(), ce.detach())
    assert (h.grad - h0.grad).abs().max() > 1e-2 and (w.grad - w0.grad).abs().max() > 1e-2


def test_each_gradient_alone_and_no_gradient_keep_the_z_sum() -> None:
    hidden, weight, targets = head_inputs(seed=1)
    z_ref = reference(hidden, weight, targets)[1]
    for grads in ((True, False), (False, True)):
        h, w = hidden.clone().requires_grad_(grads[0]), weight.clone().requires_grad_(grads[1])
        h_ref, w_ref = hidden.clone().requires_grad_(grads[0]), weight.clone().requires_grad_(grads[1])
        ce, z = head_losses(h, w, targets, 16, z_loss=COEFF)
        ce.backward()
        reference(h_ref, w_ref, targets)[2].backward()
        got, want = (h.grad, h_ref.grad) if grads[0] else (w.grad, w_ref.grad)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert (h.grad is None) != grads[0] and (w.grad is None) != grads[1]
    with torch.no_grad():
        ce, z = head_losses(hidden, weight, targets, 16, z_loss=COEFF)
    torch.testing.assert_close(z, z_ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(ce, head_cross_entropy(hidden, weight, targets), rtol=1e-6, atol=1e-5)


def _sharded_worker(rank: int, port: int, tmp: str) -> None:
    join_as_rank(rank, port)
    import torch.distributed as dist

    from lmforge.model.vocab_parallel import VocabShard
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed

    init_distributed(timeout_minutes=2)
    hidden, weight, targets = head_inputs(seed=2, vocab=256)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ce_ref, z_ref, objective = reference(h_ref, w_ref, targets)
    (objective * 0.37).backward()
    rows = slice(rank * 128, (rank + 1) * 128)
    found: dict[str, float] = {}
    for chunk in (0, 7, 64):
        h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
        ce, z = head_losses(h, w, targets, chunk, VocabShard(dist.group.WORLD, rows.start), z_loss=COEFF)
        (ce * 0.37).backward()
        assert z is not None and h.grad is not None and w.grad is not None
        grad_hidden = h.grad.clone()
        dist.all_reduce(grad_hidden)  # each rank's is its vocabulary rows' part
        found[f"{chunk}/loss"] = abs(ce.item() - ce_ref.item()) / ce_ref.item()
        found[f"{chunk}/z"] = abs(z.item() - z_ref.item()) / z_ref.item()
        found[f"{chunk}/hidden"] = ((grad_hidden - h_ref.grad).abs().max() / h_ref.grad.abs().max()).item()
        found[f"{chunk}/head"] = ((w.grad - w_ref.grad[rows]).abs().max() / w_ref.grad.abs().max()).item()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(found))
    shutdown_distributed()


@pytest.mark.slow
def test_the_vocabulary_split_head_trains_on_ce_plus_z(tmp_path: Path) -> None:
    for found in run_ranks(_sharded_worker, (free_port(), str(tmp_path)), tmp_path, timeout=120):
        assert len(found) == 12
        for key, err in found.items():
            assert err < 1e-5, (key, err)


@pytest.mark.parametrize("chunk", [0, 16])
def test_the_accumulated_gradient_is_that_of_mean_ce_plus_z(one_thread: None, chunk: int) -> None:
    model = build_model(tiny_llama(), 128, "sdpa", CPU)
    init_weights(model, 0.02, 0)
    model.loss_chunk_tokens, model.z_loss = chunk, COEFF
    batches = make_batches(3)
    stats = run_micro_batches(model, batches, CPU)
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # reference: one forward over the concatenated rows, mean over all loss tokens of CE + COEFF x lse^2
    logits = torch.cat([model(b.input_ids, b.position_ids, b.doc_lens) for b in batches], dim=1)[0].float()
    targets = torch.cat([b.target_ids for b in batches], dim=1)[0]
    mask = torch.cat([b.loss_mask for b in batches], dim=1)[0]
    ce = F.cross_entropy(logits, targets, reduction="none")[mask].mean()
    z = torch.logsumexp(logits, dim=-1)[mask].square().mean()
    (ce + COEFF * z).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(accumulated[n], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert stats.z_sum is not None
    assert abs(float(stats.loss_sum) / float(stats.loss_tokens) - ce.item()) < 1e-5
    assert abs(float(stats.z_sum) / float(stats.loss_tokens) - z.item()) < 1e-4 * z.item()


@pytest.mark.parametrize("chunk", [0, 16])
def test_multi_token_prediction_depths_take_the_z_term_with_their_weight(chunk: int) -> None:
    model = _lmforge(tiny_deepseek(num_nextn_predict_layers=2)).train()
    twin = _lmforge(tiny_deepseek(num_nextn_predict_layers=2)).train()
    model.z_loss, model.loss_chunk_tokens = COEFF, chunk
    inputs, targets, positions = _row(3)
    scale = torch.tensor([0.3, 0.07])
    model.mtp_scale.copy_(scale)
    loss = model(inputs, positions, DOCS, targets=targets)
    loss.backward()
    x, cos, sin, mask = twin.model.inputs(inputs, positions, DOCS)
    hidden = twin.model.decode(x, cos, sin, mask)
    weight = twin.lm_head.weight
    main_ce, main_z, main = reference(hidden, weight, targets[0])
    torch.testing.assert_close(loss.detach(), main_ce.detach(), rtol=1e-6, atol=1e-5)  # the main CE alone
    assert model.z_sum is not None
    torch.testing.assert_close(model.z_sum, main_z.detach(), rtol=1e-5, atol=1e-4)
    depths = twin.model.mtp_hidden(hidden, inputs[0], targets[0], cos, sin, mask)
    total = main + sum(s * reference(h, weight, t)[2] for s, (h, t) in zip(scale, depths, strict=True))
    total.backward()
    theirs = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert theirs[name].grad is None, name
            continue
        # Relative to the largest entry: sums over every position and depth round to ~5e-7 of it in fp32.
        want = theirs[name].grad
        err = ((p.grad - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, (name, err)


def z_config(tmp_path: Path, z_loss: float, **overrides: object) -> TrainConfig:
    """The tiny fake-data run of `test_micro_batches` with `model.z_loss`."""
    return train_config(tmp_path, model={"arch": tiny_llama().model_dump(), "z_loss": z_loss}, **overrides)


def _run(tmp_path: Path, ctx: DistContext, z_loss: float) -> tuple[list[dict[str, float]], int]:
    """Two steps of the tiny fake-data run (same init, same data) with `z_loss`: the logged records of steps > 0,
    and the model's vocabulary."""
    config = z_config(tmp_path, z_loss, max_steps=2)
    trainer = Trainer(config, ctx, console=False)
    vocab = trainer.model.vocab_size
    trainer.train()
    records = read_metrics(Path(config.output_dir) / "metrics.jsonl")
    return [r for r in records if r["step"] > 0 and "loss/mean" in r], vocab


def test_a_run_logs_loss_z_beside_the_unchanged_cross_entropy(ctx: DistContext, tmp_path: Path,
                                                              one_thread: None) -> None:  # fmt: skip
    (plain, _), (with_z, vocab) = _run(tmp_path / "plain", ctx, 0.0), _run(tmp_path / "z", ctx, 0.1)
    assert [r["step"] for r in plain] == [r["step"] for r in with_z] == [1, 2]
    assert all("loss/z" not in r for r in plain)
    # Step 1 starts from the same weights on the same data: the same cross-entropy to the bit, another gradient (at
    # init the softmax is near uniform, so the z term's gradient, 2 c lse W^T softmax, is a small share of it).
    assert with_z[0]["loss/mean"] == plain[0]["loss/mean"]
    assert abs(with_z[0]["optim/grad_norm"] / plain[0]["optim/grad_norm"] - 1) > 1e-4
    # loss/z is the mean lse^2 of the step's loss tokens: here about log(vocab)^2, with logits near zero at init.
    for record in with_z:
        assert record["loss/z"] == pytest.approx(math.log(vocab) ** 2, rel=0.05)
    assert with_z[1]["loss/mean"] != plain[1]["loss/mean"]  # the updates differed


def test_a_nonfinite_micro_batch_is_skipped_whole_with_z_loss(ctx: DistContext, tmp_path: Path,
                                                              one_thread: None) -> None:  # fmt: skip
    config = z_config(tmp_path, 1e-2)
    batches = [make_batches(4, seed=s) for s in range(3)]
    result = poisoned_vs_clean(config, ctx, batches, bad=(1, 2))
    metrics, ref_metrics = result["metrics"], result["ref"]
    assert result["hits"] == 1
    assert [m["loss/nan_count"] for m in metrics] == [0.0, 1.0, 0.0]
    for m, r in zip(metrics, ref_metrics, strict=True):
        for key in ("loss/mean", "loss/z", "optim/grad_norm"):
            assert m[key] == r[key], key
    assert result["same_params"]


@pytest.mark.parametrize("chunk", [0, 16])
def test_steps_with_z_loss_read_nothing_more_on_the_host(
    ctx: DistContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    config: TrainConfig = sync_config(tmp_path, model={"z_loss": 1e-3, "loss_chunk_tokens": chunk})
    detector, names = run_checked(Trainer(config, ctx, console=False), monkeypatch)
    assert "loss/z" in names
    found = [f"{e.op} at {e.where}" for e in detector.events]
    assert expected_reads("dense", found), detector.report()
