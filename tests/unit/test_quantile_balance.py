"""The quantile balancing rule: histogram quantiles against numpy's, the balancing bias against a top-k count, the
adaptive range, the routers' on-device histograms, a skewed router repaired in a few steps (on scores and on
logits), freezing, and the checkpointed grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.config.model import MoEBalanceConfig
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.model.moe import Router
from lmforge.train.callbacks.balancing import MoEBalancer, histogram_quantiles, next_range, quantile_bias
from tests.unit.test_moe import tiny_glm

CPU = torch.device("cpu")


def glm_model(**arch: object) -> CausalLM:
    model = build_model(tiny_glm(num_hidden_layers=2, routed_scaling_factor=1.0, **arch), 256, "sdpa", CPU)
    init_weights(model, 0.02, 0, None, {})
    return model.train()


def quantile_cfg(**fields: object) -> MoEBalanceConfig:
    return MoEBalanceConfig(coeff=1e-3, rule="quantile", **fields)


def test_histogram_quantiles_match_numpy_within_a_bin() -> None:
    gen = np.random.default_rng(0)
    values = np.stack([gen.normal(0.3, 0.1, 20_000), gen.uniform(0.1, 0.9, 20_000), gen.beta(2, 5, 20_000)])
    bins, lo, hi = 512, 0.0, 1.0
    hist = np.stack([np.histogram(np.clip(v, lo, hi), bins=bins, range=(lo, hi))[0] for v in values])
    for level in (0.5, 0.75, 0.9):
        got = histogram_quantiles(hist, lo, hi, level)
        want = np.quantile(values, level, axis=1)
        assert np.abs(got - want).max() < (hi - lo) / bins, level
    # One value per bin: the interpolation lands inside the right bin; an empty row has no quantile.
    assert histogram_quantiles(np.array([[0.0, 4.0, 0.0, 0.0]]), 0.0, 4.0, 0.5)[0] == pytest.approx(1.5)
    assert np.isnan(histogram_quantiles(np.zeros((1, 4)), 0.0, 1.0, 0.5)[0])


def top_k_loads(values: np.ndarray, bias: np.ndarray, k: int) -> np.ndarray:
    """Share of tokens choosing each column of values [T, C] when each token takes its k largest biased values."""
    chosen = np.argsort(-(values + bias), axis=1)[:, :k]
    return np.bincount(chosen.reshape(-1), minlength=values.shape[1]) / values.shape[0]


def test_quantile_bias_equalizes_a_top_k_count() -> None:
    gen = np.random.default_rng(1)
    experts, k, tokens = 8, 2, 40_000
    # Sigmoid scores of experts with different locations and spreads: without a bias the top experts take most.
    logits = gen.normal(size=(tokens, experts)) * np.linspace(0.5, 1.5, experts) + np.linspace(-1.0, 1.5, experts)
    scores = 1 / (1 + np.exp(-logits))
    hist = np.stack([np.histogram(scores[:, e], bins=256, range=(0.0, 1.0))[0] for e in range(experts)])
    bias = quantile_bias(hist, 0.0, 1.0, k)
    assert bias.mean() == pytest.approx(0.0, abs=1e-12)
    before, after = top_k_loads(scores, np.zeros(experts), k), top_k_loads(scores, bias, k)
    assert before.max() / before.mean() > 2.0 and before.min() / before.mean() < 0.05
    assert abs(after.sum() - k) < 1e-9 and after.max() / after.mean() < 1.2 and after.min() / after.mean() > 0.8


def test_next_range_narrows_to_the_values_and_grows_at_a_hit_edge() -> None:
    hist = np.zeros((2, 100))
    hist[0, 40:50] = 1
    hist[1, 45:60] = 1  # occupied bins 40..59 of [0, 1]: [0.4, 0.6], widened by half its span on each side
    assert next_range(hist, 0.0, 1.0) == pytest.approx((0.3, 0.7))
    hist[1, 99] = 1  # the top edge holds values that may lie beyond it
    assert next_range(hist, 0.0, 1.0) == pytest.approx((0.0, 2.0))
    hist[0, 0] = 1
    assert next_range(hist, -1.0, 1.0) == pytest.approx((-3.0, 3.0))
    assert next_range(np.zeros((2, 100)), -1.0, 1.0) == (-1.0, 1.0)


@pytest.mark.parametrize("on_logits", [False, True], ids=["scores", "logits"])
def test_router_histograms_equal_numpy_histograms_of_its_selection_values(on_logits: bool) -> None:
    model = glm_model(router_bias_on_logits=on_logits, null_experts=2)
    gate = model.moe_layers()[1].gate
    assert isinstance(gate, Router)
    lo, hi = (-0.5, 0.5) if on_logits else (0.4, 0.6)
    gate.start_recording(32, lo, hi)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gate(x[:100])
        gate(x[100:])
        gate.eval()
        gate(x)  # evaluation forwards are not recorded
    logits = (x @ gate.weight.detach().T).double().numpy()
    values = logits if on_logits else 1 / (1 + np.exp(-logits))
    assert values.shape[1] == 10, "8 routed and 2 null choices"
    edges = np.clip(values, lo, hi - 1e-9)
    want = np.stack([np.histogram(edges[:, e], bins=32, range=(lo, hi))[0] for e in range(10)])
    got = gate.choice_histogram.numpy()
    assert got.shape == (10, 32) and got.sum() == 3000
    assert np.abs(got - want).sum() <= 4, "bin edges may round apart for a value or two"
    assert got[:, [0, -1]].sum() > 0, "values outside the range count in the edge bins"


def run_skewed(steps: int, on_logits: bool, rule: str = "quantile") -> tuple[list[float], MoEBalancer]:
    """A router pushed towards experts 0 and 1 for every token; each step routes 1024 fresh tokens through the
    recording router and feeds the balancer the step's counts and histograms, as the trainer does."""
    torch.manual_seed(0)
    model = glm_model(router_bias_on_logits=on_logits)
    moe = model.moe_layers()[1]
    with torch.no_grad():
        moe.gate.weight[:2] += 0.02
    cfg = quantile_cfg(quantile_rate=1.0) if rule == "quantile" else MoEBalanceConfig(coeff=5e-3)
    balancer = MoEBalancer(model, cfg, None, max_steps=steps)
    vio = []
    for step in range(1, steps + 1):
        balancer.start_step([], step)
        with torch.no_grad():
            routing = moe.gate(torch.randn(1024, 64) + 1.0)
        counts = torch.bincount(routing.indices.reshape(-1), minlength=8).double().numpy()[None]
        sums = {k: v.double().numpy() for k, v in balancer.device_stats().items()}
        metrics = balancer.update(step, counts, np.array([1024.0]), None, None, sums.get("moe/choice_hist"))
        vio.append(metrics["max_vio/mean"])
    return vio, balancer


@pytest.mark.parametrize("on_logits", [False, True], ids=["scores", "logits"])
def test_quantile_rule_repairs_a_skewed_router_in_a_few_steps(on_logits: bool) -> None:
    vio, balancer = run_skewed(12, on_logits)
    sign, _ = run_skewed(12, on_logits, rule="sign")
    assert vio[0] == sign[0] == 3.0, "experts 0 and 1 take every token at the start"
    assert max(vio[4:]) < 0.5, vio  # the range settles in a step or two, then the loads are near equal
    assert min(sign) > 1.0, "the sign rule at its usual rate needs far longer"
    assert balancer.ranges[0] != (0.0, 1.0) and balancer.ranges[0] != (-1.0, 1.0), "the range follows the values"
    occupied = np.flatnonzero(balancer.balanced[0].gate.choice_histogram.sum(0).numpy())
    assert occupied[0] > 0 and occupied[-1] < 255, "the last step's values all fell inside the range"
    assert occupied[-1] - occupied[0] >= 64, "and they spread over a good share of its bins"


def test_freeze_stops_recording_and_moving() -> None:
    model = glm_model()
    balancer = MoEBalancer(model, quantile_cfg(freeze_at=0.5), None, max_steps=4)
    gate = model.moe_layers()[1].gate
    x = torch.randn(64, 64)
    for step in range(1, 5):
        balancer.start_step([], step)
        with torch.no_grad():
            gate(x)
        stats = balancer.device_stats()
        assert ("moe/choice_hist" in stats) == (step <= 2) and gate.record_choices == (step <= 2)
        before = gate.e_score_correction_bias.clone()
        hist = stats["moe/choice_hist"].double().numpy() if step <= 2 else None
        balancer.update(step, np.full((1, 8), 16.0), np.array([64.0]), None, None, hist)
        assert torch.equal(gate.e_score_correction_bias, before) == (step > 2), step


def test_grid_is_checkpointed_and_a_different_grid_is_refused() -> None:
    _, balancer = run_skewed(3, on_logits=True)
    state = balancer.state_dict()
    assert state["quantile_bins"] == 256 and state["ranges"] == [list(balancer.ranges[0])]
    fresh = MoEBalancer(glm_model(router_bias_on_logits=True), quantile_cfg(), None, max_steps=3)
    assert fresh.ranges != balancer.ranges
    fresh.load_state_dict(state)
    assert fresh.ranges == balancer.ranges
    other = MoEBalancer(glm_model(), quantile_cfg(quantile_bins=64), None, max_steps=3)
    with pytest.raises(ValueError, match=r"model\.moe_balance\.quantile_bins 64"):
        other.load_state_dict(state)
    assert MoEBalancer(glm_model(), MoEBalanceConfig(), None, max_steps=3).state_dict() == {}, "sign rule: none"


def test_a_compiled_block_records_the_eager_histogram_and_a_new_range_does_not_recompile() -> None:
    from lmforge.model.attention import DocumentMask
    from lmforge.model.rotary import rotary_cos_sin

    model = glm_model(router_bias_on_logits=True)
    block = model.blocks[1]
    gate = model.moe_layers()[1].gate
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(8))
    cos, sin = rotary_cos_sin(torch.arange(24), model.arch, torch.float32)
    mask = DocumentMask.from_doc_lens(torch.tensor([10, 14]), CPU)
    gate.start_recording(64, -0.3, 0.3)
    with torch.no_grad():
        block(x, cos, sin, mask)
    eager = gate.choice_histogram.clone()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    counter = torch._dynamo.utils.counters
    counter.clear()
    for lo, hi in ((-0.3, 0.3), (-0.5, 0.2)):
        gate.start_recording(64, lo, hi)
        with torch.no_grad():
            compiled(x, cos, sin, mask)
        if lo == -0.3:
            assert torch.equal(gate.choice_histogram, eager)
    assert gate.choice_histogram.sum() == 24 * 8 and not torch.equal(gate.choice_histogram, eager)
    assert counter["stats"]["unique_graphs"] == 1, "the range is a device tensor: one graph for both"
