"""Muon: the Newton–Schulz band, equality with `torch.optim.Muon`, and FSDP2 sharding over 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lmforge.optim.muon as muon_module
from lmforge.optim.muon import Muon, newton_schulz
from tests.spawn import run_ranks

# singular values after 5 default-coefficient steps of a random well-conditioned rectangular matrix: measured
# 0.68183–1.13436 over 300 seeds of 64x32, 32x96, 9x45 and 67x40 (the quintic's fixed-point band; torch documents
# "roughly 0.5 to 1.5"). Near-singular inputs (e.g. random square matrices) keep tiny singular values tiny.
SV_BAND = (0.68, 1.135)

# ours -> torch.optim.Muon's adjust_lr_fn
TORCH_ADJUST = {"spectral": "original", "match_adamw_rms": "match_rms_adamw"}


@pytest.mark.parametrize("shape", [(64, 32), (32, 96)])
def test_newton_schulz_singular_values_in_band(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        g = torch.randn(*shape, generator=gen)
        out = newton_schulz(g, 5, (3.4445, -4.7750, 2.0315), 1e-7)
        assert out.shape == g.shape and out.dtype == g.dtype
        sv = torch.linalg.svdvals(out)
        assert SV_BAND[0] <= sv.min().item() and sv.max().item() <= SV_BAND[1], (sv.min(), sv.max())


def test_newton_schulz_tall_is_transposed_wide() -> None:
    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(g).T, newton_schulz(g.T.contiguous()), rtol=0, atol=1e-6)
    # a zero matrix (e.g. the zero-grad step `get_state_dict` runs) stays zero instead of becoming NaN
    assert newton_schulz(torch.zeros(4, 6)).abs().max() == 0


def test_newton_schulz_close_to_torch_bf16() -> None:
    # torch iterates in bf16 even on CPU; ours in fp32 there, so only a bf16-sized tolerance applies
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(2))
    theirs = _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    torch.testing.assert_close(newton_schulz(g), theirs, rtol=0, atol=3e-2)


@pytest.fixture
def torch_muon_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.optim.Muon iterate Newton–Schulz in fp32 (its only precision cut), so it can be compared at 1e-6."""
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.to(torch.float32, copy=True))


def _random_mats(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for shape in [(67, 32), (32, 45), (9, 40), (24, 24)]]


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.95, "nesterov": True, "weight_decay": 0.0, "adjust_lr": "spectral"},
        {"momentum": 0.9, "nesterov": False, "weight_decay": 0.1, "adjust_lr": "match_adamw_rms"},
        {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05, "adjust_lr": "match_adamw_rms", "ns_steps": 3},
    ],
)
def test_single_process_equals_torch_muon(settings: dict[str, object], torch_muon_in_fp32: None) -> None:
    ours_p = [nn.Parameter(m.clone()) for m in _random_mats(3)]
    theirs_p = [nn.Parameter(m.clone()) for m in _random_mats(3)]
    kwargs = {k: v for k, v in settings.items() if k != "adjust_lr"}
    ours = Muon(ours_p, lr=0.02, adjust_lr=settings["adjust_lr"], **kwargs)
    theirs = torch.optim.Muon(theirs_p, lr=0.02, adjust_lr_fn=TORCH_ADJUST[settings["adjust_lr"]], **kwargs)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for a, b in zip(ours_p, theirs_p, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    for a, b in zip(ours_p, theirs_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"])


def test_groups_override_hyperparameters() -> None:
    a, b = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.zeros(8, 4))
    opt = Muon([{"params": [a]}, {"params": [b], "lr": 0.0}], lr=0.1)
    a.grad = torch.ones(8, 4)
    b.grad = torch.ones(8, 4)
    opt.step()
    assert a.abs().sum() > 0 and b.abs().sum() == 0


def test_rejects_non_matrix_params() -> None:
    with pytest.raises(ValueError, match=r"\(16,\)"):
        Muon([nn.Parameter(torch.zeros(16))], lr=0.1)
    opt = Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.1)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 3, 4))]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.1, adjust_lr="original")


def test_state_dict_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(m.shape, generator=gen) for m in _random_mats(0)] for _ in range(4)]

    def run(steps: range, params: list[nn.Parameter], opt: Muon) -> None:
        for s in steps:
            for p, g in zip(params, grads[s], strict=True):
                p.grad = g.clone()
            opt.step()

    straight = [nn.Parameter(m) for m in _random_mats(0)]
    opt = Muon(straight, lr=0.02, weight_decay=0.1)
    run(range(4), straight, opt)

    first = [nn.Parameter(m) for m in _random_mats(0)]
    opt1 = Muon(first, lr=0.02, weight_decay=0.1)
    run(range(2), first, opt1)
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Muon(resumed, lr=0.02, weight_decay=0.1)
    opt2.load_state_dict(opt1.state_dict())
    run(range(2, 4), resumed, opt2)
    for a, b in zip(straight, resumed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- FSDP2 over 2 gloo ranks


def _model() -> nn.Sequential:
    # weights 67x40 (tall), 45x67 (wide), 9x45, 1x9: odd row counts, and 1 row leaves rank 1 with an empty shard
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(40, 67, bias=False),
        nn.Linear(67, 45, bias=False),
        nn.Linear(45, 9, bias=False),
        nn.Linear(9, 1, bias=False),
    )


STEPS = 3
OPT_KWARGS: dict[str, object] = {"lr": 0.02, "weight_decay": 0.1}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 40, generator=torch.Generator().manual_seed(100 + step))


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = Muon(model.parameters(), **OPT_KWARGS)
    for step in range(STEPS):
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    calls: list[list[int]] = []
    real_ns = muon_module.newton_schulz

    def counting_ns(g: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(list(g.shape))
        return real_ns(g, *args)

    muon_module.newton_schulz = counting_ns
    try:
        model = _model()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        local_rows = [p.to_local().shape[0] for p in model.parameters()]
        opt = Muon(model.parameters(), **OPT_KWARGS)
        per_step = []
        for step in range(STEPS):
            model(_batch(step)).square().mean().backward()
            before = len(calls)
            opt.step()
            per_step.append(calls[before:])
            opt.zero_grad()
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}

        # checkpoint helpers: a fresh optimizer gets its state through a zero-grad, lr=0 step, which must not move
        # the params; then loading the saved state must give back the same momentum buffers
        saved = get_optimizer_state_dict(model, opt)
        fresh = Muon(model.parameters(), **OPT_KWARGS)
        before = len(calls)
        set_optimizer_state_dict(model, fresh, saved)
        init_calls = len(calls) - before
        unchanged = all(torch.equal(full[k], v.full_tensor()) for k, v in model.state_dict().items())
        same_state = all(
            torch.equal(fresh.state[p]["momentum_buffer"].full_tensor(), opt.state[p]["momentum_buffer"].full_tensor())
            for p in model.parameters()
        )

        # a matrix without a gradient on every rank is skipped everywhere; one on some ranks only fails everywhere
        params = list(model.parameters())
        for p in params[:3]:
            p.grad = torch.ones_like(p)
        last = params[3].full_tensor()
        before = len(calls)
        opt.step()
        skipped = len(calls) - before == (2 if rank == 0 else 1) and torch.equal(params[3].full_tensor(), last)
        opt.zero_grad()
        if rank == 0:
            params[0].grad = torch.ones_like(params[0])
        try:
            opt.step()
            raised = ""
        except RuntimeError as err:
            raised = str(err)

        if rank == 0:
            torch.save(full, Path(out_dir, "full.pt"))
        result = {
            "skipped": skipped,
            "raised": raised,
            "per_step": per_step,
            "local_rows": local_rows,
            "init_calls": init_calls,
            "unchanged": unchanged,
            "same_state": same_state,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        muon_module.newton_schulz = real_ns
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp2_two_ranks_equals_single_process(tmp_path: Path) -> None:
    results = run_ranks(_worker, (str(tmp_path / "init"), str(tmp_path)), tmp_path, timeout=120)

    # rows split like torch.chunk: rank 1 has fewer rows of every odd matrix, and none of the 1-row one
    assert results[0]["local_rows"] == [34, 23, 5, 1]
    assert results[1]["local_rows"] == [33, 22, 4, 0]
    shapes = [[67, 40], [45, 67], [9, 45], [1, 9]]
    for step in range(STEPS):
        # matrix i is orthogonalized whole, once, by rank i % 2
        assert results[0]["per_step"][step] == [shapes[0], shapes[2]]
        assert results[1]["per_step"][step] == [shapes[1], shapes[3]]
    for res in results:
        assert res["init_calls"] == 2 and res["unchanged"] and res["same_state"]
        assert res["skipped"] and "(67, 40) parameter has a gradient on some ranks only" in res["raised"]

    full = torch.load(tmp_path / "full.pt")
    reference = _reference()
    assert full.keys() == reference.keys()
    for k, v in reference.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6)
    assert not torch.equal(reference["0.weight"], _model()[0].weight.detach())
