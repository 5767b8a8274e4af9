"""Muon: the Newton–Schulz band, equality with `torch.optim.Muon` (per expert for 3-D expert stacks), FSDP2 sharding
over 2 gloo ranks, and which optimizer `build_optimizer` gives the MoE expert stacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lmforge.optim.muon as muon_module
from lmforge.config.optim import MuonConfig
from lmforge.model import build_model
from lmforge.optim import build_optimizer
from lmforge.optim.muon import Muon, newton_schulz
from tests.spawn import run_ranks
from tests.unit.test_moe import tiny_qwen3_moe

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


@pytest.mark.parametrize(
    "shape", [(3, 40, 24), (3, 24, 40), (2, 3, 9, 5), (0, 8, 4)], ids=["tall", "wide", "4-d", "empty"]
)
def test_newton_schulz_batch_equals_each_matrix(shape: tuple[int, ...]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    if g.numel():
        g[(0,) * (len(shape) - 2)].zero_()  # a zero matrix in the batch stays zero, the others are unaffected
    out = newton_schulz(g)
    assert out.shape == g.shape and out.dtype == g.dtype
    for each_g, each_out in zip(g.flatten(0, -3), out.flatten(0, -3), strict=True):
        torch.testing.assert_close(each_out, newton_schulz(each_g), rtol=0, atol=1e-5)


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


@pytest.mark.parametrize("shape", [(3, 40, 24), (3, 24, 40)], ids=["tall", "wide"])
@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.95, "nesterov": True, "weight_decay": 0.0, "adjust_lr": "spectral"},
        {"momentum": 0.9, "nesterov": False, "weight_decay": 0.1, "adjust_lr": "match_adamw_rms"},
        {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05, "adjust_lr": "match_adamw_rms"},
    ],
    ids=["nesterov", "plain-decay", "nesterov-decay"],
)
def test_expert_stack_equals_torch_muon_per_expert(
    shape: tuple[int, int, int], settings: dict[str, object], torch_muon_in_fp32: None
) -> None:
    stack = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    ours_p = nn.Parameter(stack.clone())
    theirs_p = [nn.Parameter(m.clone()) for m in stack]
    kwargs = {k: v for k, v in settings.items() if k != "adjust_lr"}
    ours = Muon([ours_p], lr=0.02, adjust_lr=settings["adjust_lr"], **kwargs)
    adjust = TORCH_ADJUST[settings["adjust_lr"]]
    theirs = [torch.optim.Muon([p], lr=0.02, adjust_lr_fn=adjust, **kwargs) for p in theirs_p]
    calls: list[tuple[int, ...]] = []
    real_ns = muon_module.newton_schulz

    def counting_ns(g: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(g.shape))
        return real_ns(g, *args)

    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        ours_p.grad = torch.randn(shape, generator=gen)
        for p, g in zip(theirs_p, ours_p.grad, strict=True):
            p.grad = g.clone()
        muon_module.newton_schulz = counting_ns
        try:
            ours.step()
        finally:
            muon_module.newton_schulz = real_ns
        for opt in theirs:
            opt.step()
    assert calls == [shape] * 3  # one batched call per step, all experts at once
    for i, p in enumerate(theirs_p):
        torch.testing.assert_close(ours_p.detach()[i], p.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.state[ours_p]["momentum_buffer"][i], theirs[i].state[p]["momentum_buffer"])


def test_rejects_non_matrix_params() -> None:
    with pytest.raises(ValueError, match=r"\(16,\)"):
        Muon([nn.Parameter(torch.zeros(16))], lr=0.1)
    opt = Muon([nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(2, 3, 4))], lr=0.1)
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 5\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 3, 4, 5))]})
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


# ---------------------------------------------------------------- MoE expert stacks: optimizer choice and FSDP2


@pytest.mark.parametrize("muon_experts", [True, False])
def test_build_optimizer_expert_stacks(muon_experts: bool) -> None:
    model = build_model(tiny_qwen3_moe(), 256, "sdpa", torch.device("cpu"))
    cfg = MuonConfig(lr=0.02, muon_experts=muon_experts, adamw_params=["model.layers.1.mlp.experts.down_proj"])
    muon, adamw = build_optimizer(model, cfg).optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {opt: {g["name"]: g["param_names"] for g in opt.param_groups} for opt in (muon, adamw)}
    stacks = {
        "expert_hidden": ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj"],
        "expert_out": ["model.layers.0.mlp.experts.down_proj"],
    }
    routers = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    if muon_experts:
        assert {k: names[muon][k] for k in stacks} == stacks
        # adamw_params still moves a matching stack to AdamW, under the usual `<role>_adamw` name
        assert names[adamw]["expert_out_adamw"] == ["model.layers.1.mlp.experts.down_proj"]
        assert not set(stacks) & set(names[adamw])
        assert all(g["weight_decay"] == cfg.weight_decay for g in muon.param_groups)
    else:
        assert names[adamw]["expert_hidden"] == stacks["expert_hidden"]
        assert names[adamw]["expert_out"] == [*stacks["expert_out"], "model.layers.1.mlp.experts.down_proj"]
        assert not set(stacks) & set(names[muon]) and "expert_out_adamw" not in names[adamw]
    assert names[adamw]["router"] == routers and set(names[muon]) >= {"hidden", "residual_out"}


HID, INTER = 20, 8  # gate_up [E, 2 INTER, HID] is wide, down [E, HID, INTER] tall


class _Stacks(nn.Module):
    """An MoE-like pair of expert stacks with 3 experts (not divisible by 2 ranks), a 1-expert stack (none on
    rank 1) and a dense matrix, every expert reached by every token so each gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate_up = nn.Parameter(torch.randn(3, 2 * INTER, HID, generator=gen) * 0.2)
        self.down = nn.Parameter(torch.randn(3, HID, INTER, generator=gen) * 0.2)
        self.solo = nn.Parameter(torch.randn(1, 6, HID, generator=gen) * 0.2)
        self.proj = nn.Parameter(torch.randn(HID, HID, generator=gen) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("nh,eah->ena", x, self.gate_up).chunk(2, dim=-1)
        y = torch.einsum("ena,eha->nh", nn.functional.silu(gate) * up, self.down) @ self.proj.T
        return y.square().mean() + torch.einsum("nh,eah->ena", y, self.solo).square().mean()


EXPERT_KWARGS: dict[str, object] = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr": "match_adamw_rms"}


def _expert_batch(step: int) -> torch.Tensor:
    return torch.randn(8, HID, generator=torch.Generator().manual_seed(200 + step))


def _expert_reference() -> dict[str, torch.Tensor]:
    model = _Stacks()
    opt = Muon(model.parameters(), **EXPERT_KWARGS)
    for step in range(STEPS):
        model(_expert_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _experts_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ns_calls: list[list[int]] = []
    collectives: list[str] = []
    real_ns, real_gather, real_a2a = muon_module.newton_schulz, dist.all_gather, dist.all_to_all_single

    def counting_ns(g: torch.Tensor, *args: object) -> torch.Tensor:
        ns_calls.append(list(g.shape))
        return real_ns(g, *args)

    def counting(name: str, fn: object) -> object:
        def wrapped(*args: object, **kwargs: object) -> object:
            collectives.append(name)
            return fn(*args, **kwargs)  # type: ignore[operator]

        return wrapped

    muon_module.newton_schulz = counting_ns
    dist.all_gather = counting("all_gather", real_gather)  # type: ignore[assignment]
    dist.all_to_all_single = counting("all_to_all_single", real_a2a)  # type: ignore[assignment]
    try:
        model = _Stacks()
        fully_shard(model)
        local_experts = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
        opt = Muon(model.parameters(), **EXPERT_KWARGS)
        per_step = []
        for step in range(STEPS):
            model(_expert_batch(step)).backward()
            before_ns, before_coll = len(ns_calls), len(collectives)
            opt.step()
            per_step.append({"ns": ns_calls[before_ns:], "collectives": collectives[before_coll:]})
            opt.zero_grad()
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}

        # the stacks' momentum buffers go through the checkpoint helpers like the matrices'
        saved = get_optimizer_state_dict(model, opt)
        fresh = Muon(model.parameters(), **EXPERT_KWARGS)
        set_optimizer_state_dict(model, fresh, saved)
        same_state = all(
            torch.equal(fresh.state[p]["momentum_buffer"].full_tensor(), opt.state[p]["momentum_buffer"].full_tensor())
            for p in model.parameters()
        )

        # a layout that splits experts cannot be orthogonalized locally
        mesh = init_device_mesh("cpu", (2,))
        split = nn.Parameter(distribute_tensor(torch.ones(3, 4, 6), mesh, [Shard(1)]))
        split.grad = distribute_tensor(torch.ones(3, 4, 6), mesh, [Shard(1)])
        try:
            Muon([split], lr=0.1).step()
            raised = ""
        except NotImplementedError as err:
            raised = str(err)

        if rank == 0:
            torch.save(full, Path(out_dir, "full.pt"))
        result = {"local_experts": local_experts, "per_step": per_step, "same_state": same_state, "raised": raised}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        muon_module.newton_schulz = real_ns
        dist.all_gather, dist.all_to_all_single = real_gather, real_a2a  # type: ignore[assignment]
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp2_expert_stacks_two_ranks_equal_single_process(tmp_path: Path) -> None:
    results = run_ranks(_experts_worker, (str(tmp_path / "init"), str(tmp_path)), tmp_path, timeout=120)

    # experts split like torch.chunk: 3 experts as 2 + 1, the 1-expert stack as 1 + 0
    assert results[0]["local_experts"] == {"gate_up": 2, "down": 2, "solo": 1, "proj": 10}
    assert results[1]["local_experts"] == {"gate_up": 1, "down": 1, "solo": 0, "proj": 10}
    for step in range(STEPS):
        # each rank orthogonalizes its own experts in one batched call per stack (an empty batch on rank 1 for the
        # 1-expert stack), with no collective; only the dense matrix is gathered whole, by rank 0
        r0, r1 = results[0]["per_step"][step], results[1]["per_step"][step]
        assert r0["ns"] == [[2, 2 * INTER, HID], [2, HID, INTER], [1, 6, HID], [HID, HID]]
        assert r1["ns"] == [[1, 2 * INTER, HID], [1, HID, INTER], [0, 6, HID]]
        # the rows table is gathered at the first step only: the layout and the gradients stay the same
        table = ["all_gather"] if step == 0 else []
        assert r0["collectives"] == r1["collectives"] == [*table, "all_to_all_single", "all_to_all_single"]
    for res in results:
        assert res["same_state"]
        assert "split along dim 0" in res["raised"] and "(3, 4, 6)" in res["raised"]

    full = torch.load(tmp_path / "full.pt")
    reference = _expert_reference()
    assert full.keys() == reference.keys()
    for k, v in reference.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6)
    assert not torch.equal(reference["gate_up"], _Stacks().gate_up.detach())
