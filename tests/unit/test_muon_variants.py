"""Muon's optional variants: Polar Express orthogonalization (its coefficient table and its accuracy), NorMuon's
per-row normalization (against a plain reference, per expert, through state_dict, and over 2 gloo ranks with
FSDP2, tensor-parallel splits and a DCP checkpoint), cautious weight decay, and their config fields."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from lmforge.config.optim import MuonConfig
from lmforge.model import build_model
from lmforge.optim import build_optimizer
from lmforge.optim.muon import Muon
from lmforge.optim.polar import (
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_DESIGN,
    newton_schulz,
    polar_express,
    polar_express_coefficients,
)
from tests.spawn import run_ranks
from tests.unit.test_moe import tiny_qwen3_moe

RECT_SHAPES = [(64, 32), (32, 96), (9, 45), (67, 40)]

# ---------------------------------------------------------------- Polar Express


def _quintic(t: tuple[float, float, float], x: np.ndarray) -> np.ndarray:
    a, b, c = t
    return a * x + b * x**3 + c * x**5


def _inner_extrema(t: tuple[float, float, float]) -> tuple[float, float]:
    """The odd quintic's inner local maximum and minimum on x > 0 (roots of p'(x) = a + 3 b x^2 + 5 c x^4)."""
    a, b, c = t
    roots = np.sqrt((-3 * b + np.array([-1.0, 1.0]) * math.sqrt(9 * b * b - 20 * a * c)) / (10 * c))
    at_max, at_min = float(roots[0]), float(roots[1])
    return float(_quintic(t, np.array(at_max))), float(_quintic(t, np.array(at_min)))


def test_polar_express_table_is_the_published_construction() -> None:
    # the design: singular values in [1e-3, 1]; quintic t maps [l, u] into [p(l), 2 - p(l)] (centred on 1)
    lo, hi = 1e-3, 1.0
    for t, triple in enumerate(POLAR_EXPRESS_DESIGN[:-1]):
        x = np.linspace(lo, hi, 200_001)
        y = _quintic(triple, x)
        p_lo, p_hi = float(_quintic(triple, np.array(lo))), float(_quintic(triple, np.array(hi)))
        assert p_lo + p_hi == pytest.approx(2.0, abs=1e-9), t
        assert y.min() >= p_lo - 1e-9 and y.max() <= 2 - p_lo + 1e-9, t
        inner_max, inner_min = _inner_extrema(triple)
        assert inner_max == pytest.approx(p_hi, rel=1e-7), t  # the error's upper peaks are equal
        if t < 3:
            # cushioned: the inner minimum is held at a tenth of the maximum instead of dipping to p(l)
            assert inner_min == pytest.approx(inner_max / 10, rel=1e-7), t
        else:
            # minimax: |p - 1| equioscillates between l, the inner minimum, the inner maximum and u
            assert inner_min == pytest.approx(p_lo, rel=1e-7), t
        lo, hi = p_lo, 2 - p_lo
    # after all 7 the design interval has shrunk to within 1 +- 2e-9; after 5, to within 1 +- 0.124
    assert abs(lo - 1) < 2e-9
    x = np.linspace(1e-3, 1, 100_001)
    for triple in POLAR_EXPRESS_DESIGN[:5]:
        x = _quintic(triple, x)
    assert np.abs(x - 1).max() < 0.124
    # the last is the limit of the sequence: Newton–Schulz's (15 x - 10 x^3 + 3 x^5) / 8
    assert POLAR_EXPRESS_DESIGN[-1] == (15 / 8, -10 / 8, 3 / 8)
    # the safety factor: p(x / 1.01) for all but the last
    for used, (a, b, c) in zip(POLAR_EXPRESS_COEFFICIENTS[:-1], POLAR_EXPRESS_DESIGN[:-1], strict=True):
        assert used == pytest.approx((a / 1.01, b / 1.01**3, c / 1.01**5), rel=1e-15)
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == POLAR_EXPRESS_DESIGN[-1]
    # more steps than published quintics repeat the last one
    ten = polar_express_coefficients(10)
    assert ten[:8] == list(POLAR_EXPRESS_COEFFICIENTS) and ten[8] == ten[9] == POLAR_EXPRESS_COEFFICIENTS[-1]
    assert polar_express_coefficients(3) == list(POLAR_EXPRESS_COEFFICIENTS[:3])


@pytest.mark.parametrize("steps", [2, 5, 10])
def test_polar_express_applies_its_quintics_to_the_singular_values(steps: int) -> None:
    # in float64 the iteration is exactly the scalar map on each singular value, after dividing by 1.01 ||G||_F
    g = torch.randn(12, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = torch.linalg.svdvals(polar_express(g, steps, compute_dtype=torch.float64))
    s = (torch.linalg.svdvals(g) / (1.01 * torch.linalg.matrix_norm(g))).numpy()
    for triple in polar_express_coefficients(steps):
        s = _quintic(triple, s)
    torch.testing.assert_close(got, torch.from_numpy(np.sort(s)[::-1].copy()), rtol=1e-10, atol=1e-12)


def test_polar_express_is_closer_to_orthogonal_than_newton_schulz() -> None:
    gen = torch.Generator().manual_seed(1)
    for shape in RECT_SHAPES:
        for _ in range(3):
            g = torch.randn(*shape, generator=gen)
            pe = torch.linalg.svdvals(polar_express(g, 5))
            ns = torch.linalg.svdvals(newton_schulz(g, 5))
            # measured: polar express 0.120-0.130, the default quintic 0.293-0.318
            pe_err, ns_err = (pe - 1).abs().max(), (ns - 1).abs().max()
            assert pe_err < 0.14 and pe_err < 0.5 * ns_err, (shape, pe_err, ns_err)
    # a batch gives each matrix its own result; a zero matrix stays zero
    stack = torch.randn(3, 24, 40, generator=gen)
    stack[1].zero_()
    out = polar_express(stack)
    assert out[1].abs().max() == 0
    for each_g, each_out in zip(stack, out, strict=True):
        torch.testing.assert_close(each_out, polar_express(each_g), rtol=0, atol=1e-5)
    tall = torch.randn(40, 24, generator=gen)
    torch.testing.assert_close(polar_express(tall).T, polar_express(tall.T.contiguous()), rtol=0, atol=5e-6)


@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (3, 24, 40)])
def test_polar_express_bf16_matches_fp32(shape: tuple[int, ...]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    fp32 = polar_express(g, 5, compute_dtype=torch.float32)
    bf16 = polar_express(g, 5, compute_dtype=torch.bfloat16)
    bf16_input = polar_express(g.bfloat16(), 5)
    assert bf16.dtype == torch.float32 and bf16_input.dtype == torch.bfloat16
    # measured: about 1.5% relative (Frobenius) and 0.011 absolute for iterating in bf16
    for other in (bf16, bf16_input.float()):
        assert torch.linalg.vector_norm(other - fp32) < 0.03 * torch.linalg.vector_norm(fp32)
        assert (other - fp32).abs().max() < 0.02
        sv = torch.linalg.svdvals(other.float())
        assert sv.min() > 0.84 and sv.max() < 1.14


# ---------------------------------------------------------------- a plain reference of every variant


def _reference_run(
    p0: torch.Tensor, grads: list[torch.Tensor], *, lr: float, momentum: float, wd: float, normuon: bool,
    cautious: bool, beta2: float = 0.95, eps: float = 1e-10,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Muon (Nesterov, "spectral" scale) on one matrix, written out step by step; returns the parameter and the
    row second moments."""
    p, buf = p0.clone(), torch.zeros_like(p0)
    v = torch.zeros(p0.shape[0], 1)
    rows, cols = p0.shape
    scale = math.sqrt(max(1.0, rows / cols))
    for g in grads:
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf
        o = newton_schulz(u)  # checked against torch.optim.Muon in test_muon.py
        if normuon:
            v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1, keepdim=True)
            n = o / (v.sqrt() + eps)
            o = n * (torch.linalg.matrix_norm(o) / torch.linalg.matrix_norm(n))
        update = scale * o
        decay = wd * p
        if cautious:
            decay = decay * ((update * p) >= 0)
        p = p - lr * (update + decay)
    return p, v


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (3, 20, 8)], ids=["tall", "wide", "stack"])
@pytest.mark.parametrize("cautious", [False, True], ids=["plain-decay", "cautious"])
def test_normuon_equals_reference(shape: tuple[int, ...], cautious: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(*shape, generator=gen)
    grads = [torch.randn(*shape, generator=gen) for _ in range(4)]
    param = nn.Parameter(p0.clone())
    opt = Muon([param], lr=0.05, momentum=0.9, weight_decay=0.2, normuon=True, cautious_weight_decay=cautious)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    v = opt.state[param]["row_second_moment"]
    assert v.shape == (*shape[:-1], 1) and v.dtype == param.dtype
    mats = [(p0, grads)] if len(shape) == 2 else [(p0[e], [g[e] for g in grads]) for e in range(shape[0])]
    plain = nn.Parameter(p0.clone())
    plain_opt = Muon([plain], lr=0.05, momentum=0.9, weight_decay=0.2, cautious_weight_decay=cautious)
    for g in grads:
        plain.grad = g.clone()
        plain_opt.step()
    for e, (p_e, g_e) in enumerate(mats):
        want_p, want_v = _reference_run(p_e, g_e, lr=0.05, momentum=0.9, wd=0.2, normuon=True, cautious=cautious)
        got_p, got_v = (param.detach(), v) if len(shape) == 2 else (param.detach()[e], v[e])
        torch.testing.assert_close(got_p, want_p, rtol=0, atol=2e-6)
        torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=0)
    # the row normalization changes the step (a tall matrix's rows differ most), so the reference can tell
    moved = (param.detach() - plain.detach()).abs().max() / (plain.detach() - p0).abs().max()
    assert moved > (0.05 if shape[0] > shape[-1] else 1e-3)


def test_cautious_weight_decay_skips_coordinates_where_signs_disagree() -> None:
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(30, 20, generator=gen)
    grad = torch.randn(30, 20, generator=gen)
    lr, wd = 0.05, 0.3
    results = {}
    for cautious in (False, True):
        param = nn.Parameter(p0.clone())
        param.grad = grad.clone()
        Muon([param], lr=lr, weight_decay=wd, cautious_weight_decay=cautious).step()
        results[cautious] = param.detach()
    # the plain step is p0 (1 - lr wd) - lr s O: recover the update's sign from it
    update = p0 * (1 - lr * wd) - results[False]
    disagree = (torch.sign(update) * torch.sign(p0)) < 0
    assert 0.3 < disagree.float().mean() < 0.7  # a random start disagrees about half the time
    # cautious decay leaves out exactly the decay of the disagreeing coordinates
    torch.testing.assert_close(
        results[True] - results[False], torch.where(disagree, lr * wd * p0, 0), rtol=0, atol=1e-6
    )
    want, _ = _reference_run(p0, [grad], lr=lr, momentum=0.95, wd=wd, normuon=False, cautious=True)
    torch.testing.assert_close(results[True], want, rtol=0, atol=1e-6)


def test_variants_off_by_default_and_checked() -> None:
    opt = Muon([nn.Parameter(torch.zeros(4, 6))], lr=0.1)
    group = opt.param_groups[0]
    assert group["orthogonalizer"] == "newton_schulz" and not group["normuon"] and not group["cautious_weight_decay"]
    for bad, field in [
        ({"orthogonalizer": "svd"}, "orthogonalizer"),
        ({"normuon_beta2": 1.0}, "normuon_beta2"),
        ({"normuon_beta2": -0.1}, "normuon_beta2"),
        ({"normuon_eps": 0.0}, "normuon_eps"),
    ]:
        with pytest.raises(ValueError, match=field):
            Muon([nn.Parameter(torch.zeros(4, 6))], lr=0.1, **bad)  # type: ignore[arg-type]
    for bad, field in [({"orthogonalizer": "svd"}, "orthogonalizer"), ({"normuon_beta2": 1.0}, "normuon_beta2")]:
        with pytest.raises(ValidationError, match=field):
            MuonConfig(lr=0.02, **bad)  # type: ignore[arg-type]


def test_build_optimizer_passes_the_variants() -> None:
    model = build_model(tiny_qwen3_moe(), 256, "sdpa", torch.device("cpu"))
    on = MuonConfig(
        lr=0.02, orthogonalizer="polar_express", normuon=True, normuon_beta2=0.9, cautious_weight_decay=True
    )
    for cfg, want in [
        (MuonConfig(lr=0.02), ("newton_schulz", False, 0.95, False)),
        (on, ("polar_express", True, 0.9, True)),
    ]:
        muon, adamw = build_optimizer(model, cfg).optimizers
        assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
        for g in muon.param_groups:
            assert (g["orthogonalizer"], g["normuon"], g["normuon_beta2"], g["cautious_weight_decay"]) == want


def test_polar_express_in_muon_uses_polar_express() -> None:
    gen = torch.Generator().manual_seed(5)
    p0, grad = torch.randn(20, 12, generator=gen), torch.randn(20, 12, generator=gen)
    param = nn.Parameter(p0.clone())
    param.grad = grad.clone()
    Muon([param], lr=0.1, orthogonalizer="polar_express", ns_steps=4).step()
    u = (1 - 0.95) * grad + 0.95 * (1 - 0.95) * grad  # Nesterov from an empty buffer
    want = p0 - 0.1 * math.sqrt(20 / 12) * polar_express(u, 4)
    torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- state_dict


def test_normuon_state_dict_round_trip() -> None:
    gen = torch.Generator().manual_seed(6)
    shapes = [(17, 9), (9, 17), (2, 6, 10)]
    init = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(4)]
    kwargs = {"lr": 0.03, "weight_decay": 0.1, "normuon": True, "orthogonalizer": "polar_express",
              "cautious_weight_decay": True}  # fmt: skip

    def run(steps: range, params: list[nn.Parameter], opt: Muon) -> None:
        for s in steps:
            for p, g in zip(params, grads[s], strict=True):
                p.grad = g.clone()
            opt.step()

    straight = [nn.Parameter(t.clone()) for t in init]
    opt = Muon(straight, **kwargs)  # type: ignore[arg-type]
    run(range(4), straight, opt)

    first = [nn.Parameter(t.clone()) for t in init]
    opt1 = Muon(first, **kwargs)  # type: ignore[arg-type]
    run(range(2), first, opt1)
    saved = opt1.state_dict()
    assert all("row_second_moment" in st for st in saved["state"].values())
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Muon(resumed, **kwargs)  # type: ignore[arg-type]
    opt2.load_state_dict(saved)
    run(range(2, 4), resumed, opt2)
    for a, b in zip(straight, resumed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(
            opt.state[a]["row_second_moment"], opt2.state[b]["row_second_moment"], rtol=0, atol=0
        )

    # without the row state the resumed run would differ: the state carries information
    fresh = [nn.Parameter(p.detach().clone()) for p in first]
    opt3 = Muon(fresh, **kwargs)  # type: ignore[arg-type]
    no_rows = opt1.state_dict()
    for st in no_rows["state"].values():
        st.pop("row_second_moment")
    opt3.load_state_dict(no_rows)
    run(range(2, 4), fresh, opt3)
    assert not torch.equal(fresh[0], straight[0])

    # a state dict saved before the variants existed loads with them off
    old = opt1.state_dict()
    for group in old["param_groups"]:
        for key in ("orthogonalizer", "normuon", "normuon_beta2", "normuon_eps", "cautious_weight_decay"):
            group.pop(key)
    plain = Muon([nn.Parameter(t.clone()) for t in init], lr=0.03)
    plain.load_state_dict(old)
    assert plain.param_groups[0]["normuon"] is False and plain.param_groups[0]["orthogonalizer"] == "newton_schulz"


# ---------------------------------------------------------------- FSDP2 and tensor parallelism over 2 gloo ranks

STEPS = 3
VARIANTS: dict[str, dict[str, object]] = {
    "normuon": {"normuon": True},
    "all": {"normuon": True, "orthogonalizer": "polar_express", "cautious_weight_decay": True, "normuon_beta2": 0.9},
}
TP_COLS, TP_ROWS = (10, 12), (8, 12)  # split by columns over a 1-D mesh; by rows over a (1, 2) mesh


class _Net(nn.Module):
    """Matrices for FSDP2's row split (13 and 1 rows: uneven, and one rank holds none of the 1-row matrix) and a
    3-expert stack (2 + 1 experts)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Parameter(torch.randn(13, 8, generator=gen) * 0.3)
        self.mix = nn.Parameter(torch.randn(6, 13, generator=gen) * 0.3)
        self.out = nn.Parameter(torch.randn(1, 6, generator=gen) * 0.3)
        self.experts = nn.Parameter(torch.randn(3, 5, 6, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.tanh(x @ self.up.T) @ self.mix.T)
        return (h @ self.out.T).square().mean() + torch.einsum("nh,eah->nea", h, self.experts).square().mean()


def _tp_init() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"cols": torch.randn(*TP_COLS, generator=gen) * 0.3, "rows": torch.randn(*TP_ROWS, generator=gen) * 0.3}


def _tp_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    return {"cols": torch.randn(*TP_COLS, generator=gen), "rows": torch.randn(*TP_ROWS, generator=gen)}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + step))


def _kwargs(variant: str) -> dict[str, object]:
    return {"lr": 0.05, "weight_decay": 0.1, **VARIANTS[variant]}


def _reference(variant: str) -> dict[str, torch.Tensor]:
    net = _Net()
    tp = {k: nn.Parameter(v) for k, v in _tp_init().items()}
    params = [*net.parameters(), *tp.values()]
    opt = Muon(params, **_kwargs(variant))  # type: ignore[arg-type]
    for step in range(STEPS):
        net(_batch(step)).backward()
        for k, g in _tp_grads(step).items():
            tp[k].grad = g
        opt.step()
        opt.zero_grad()
    named = {**{f"net.{n}": p for n, p in net.named_parameters()}, **{f"tp.{k}": p for k, p in tp.items()}}
    out = {n: p.detach().clone() for n, p in named.items()}
    out.update({f"{n}/v": opt.state[p]["row_second_moment"].clone() for n, p in named.items()})
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        col_mesh = init_device_mesh("cpu", (2,))
        row_mesh = init_device_mesh("cpu", (1, 2))
        layouts = {"cols": (col_mesh, [Shard(1)]), "rows": (row_mesh, [Shard(0), Shard(0)])}

        def build(variant: str) -> tuple[nn.Module, Muon]:
            root = nn.Module()
            root.net = _Net()
            fully_shard(root.net)
            root.tp = nn.Module()
            for k, t in _tp_init().items():
                mesh, placements = layouts[k]
                root.tp.register_parameter(k, nn.Parameter(distribute_tensor(t, mesh, placements)))
            return root, Muon(root.parameters(), **_kwargs(variant))  # type: ignore[arg-type]

        def step(root: nn.Module, opt: Muon, s: int) -> None:
            root.net(_batch(s)).backward()
            for k, g in _tp_grads(s).items():
                mesh, placements = layouts[k]
                getattr(root.tp, k).grad = distribute_tensor(g, mesh, placements)
            opt.step()
            opt.zero_grad()

        result: dict[str, object] = {}
        for variant in VARIANTS:
            root, opt = build(variant)
            ckpt = Path(out_dir, f"ckpt-{variant}")
            for s in range(STEPS):
                if s == STEPS - 1:
                    model_sd, optim_sd = get_state_dict(root, opt)
                    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
                step(root, opt, s)
            named = dict(root.named_parameters())
            full = {n: p.full_tensor() for n, p in named.items()}
            full.update({f"{n}/v": opt.state[p]["row_second_moment"].full_tensor() for n, p in named.items()})
            result[f"{variant}/v_placements"] = {
                n: [str(pl) for pl in opt.state[p]["row_second_moment"].placements] for n, p in named.items()
            }
            result[f"{variant}/v_local_rows"] = {
                n: opt.state[p]["row_second_moment"].to_local().shape[0] for n, p in named.items()
            }

            # resume from the checkpoint taken before the last step: the last step must come out the same
            resumed, opt2 = build(variant)
            model_sd, optim_sd = get_state_dict(resumed, opt2)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
            set_state_dict(resumed, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
            step(resumed, opt2, STEPS - 1)
            again = dict(resumed.named_parameters())
            result[f"{variant}/resumed_equal"] = all(
                torch.equal(again[n].full_tensor(), full[n])
                and torch.equal(opt2.state[again[n]]["row_second_moment"].full_tensor(), full[f"{n}/v"])
                for n in named
            )
            if rank == 0:
                torch.save(full, Path(out_dir, f"{variant}.pt"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_normuon_fsdp2_and_tensor_parallel_two_ranks_equal_single_process(tmp_path: Path) -> None:
    results = run_ranks(_worker, (str(tmp_path / "init"), str(tmp_path)), tmp_path, timeout=170)
    for variant in VARIANTS:
        for rank, res in enumerate(results):
            assert res[f"{variant}/resumed_equal"], (variant, rank)
            # the row state is split like the rows: FSDP's Shard(0), the row split kept, the column split replicated
            placements = res[f"{variant}/v_placements"]
            rows, whole = str(Shard(0)), str(Replicate())
            assert placements["net.up"] == placements["net.experts"] == [rows]
            assert placements["tp.cols"] == [whole] and placements["tp.rows"] == [rows, rows]
            local = res[f"{variant}/v_local_rows"]
            rows_held = {"net.up": 7 - rank, "net.mix": 3, "net.out": 1 - rank, "net.experts": 2 - rank}
            assert local == {**rows_held, "tp.cols": 10, "tp.rows": 4}
        full = torch.load(tmp_path / f"{variant}.pt")
        reference = _reference(variant)
        assert full.keys() == reference.keys()
        for k, want in reference.items():
            err = ((full[k] - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (variant, k, err)
        assert reference["net.up/v"].abs().min() > 0  # every row's state was written
    # the variants change the result, so equality above is not equality of two unchanged runs
    plain = _reference_plain()
    for k, want in plain.items():
        assert not torch.allclose(torch.load(tmp_path / "normuon.pt")[k], want, rtol=0, atol=1e-6), k


def _reference_plain() -> dict[str, torch.Tensor]:
    net = _Net()
    tp = {k: nn.Parameter(v) for k, v in _tp_init().items()}
    opt = Muon([*net.parameters(), *tp.values()], lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        net(_batch(step)).backward()
        for k, g in _tp_grads(step).items():
            tp[k].grad = g
        opt.step()
        opt.zero_grad()
    # the 1-row matrix is left out: one row has nothing to even out
    named = {**{f"net.{n}": p for n, p in net.named_parameters()}, **{f"tp.{k}": p for k, p in tp.items()}}
    return {n: p.detach().clone() for n, p in named.items() if n != "net.out"}
