"""Auxiliary-loss-free balancing and routing metrics: the sign rule, hand-computed statistics, a skewed router that
balancing repairs, and freezing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.config.model import MoEBalanceConfig
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.train.callbacks.balancing import MoEBalancer, load_metrics, load_stats
from tests.unit.test_moe import tiny_glm, tiny_qwen3_moe

CPU = torch.device("cpu")


def glm_model(layers: int = 3) -> CausalLM:
    model = build_model(tiny_glm(num_hidden_layers=layers, routed_scaling_factor=1.0), 256, "sdpa", CPU)
    init_weights(model, 0.02, 0, None, {})
    return model.train()


def test_load_statistics_by_hand() -> None:
    counts = np.array([[4.0, 0.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]])
    stats = load_stats(counts)
    assert stats["max_vio"].tolist() == [1.0, 0.0]
    assert stats["min_mean"].tolist() == [0.0, 1.0] and stats["max_mean"].tolist() == [2.0, 1.0]
    # population std of [4, 0, 2, 2] is sqrt(2); over the mean 2
    assert stats["cv"][0] == pytest.approx(math.sqrt(2) / 2) and stats["cv"][1] == 0.0
    # shares 1/2, 0, 1/4, 1/4: entropy (ln 2 / 2 + ln 4 / 2) over ln 4 = 0.75
    assert stats["entropy"][0] == pytest.approx(0.75) and stats["entropy"][1] == pytest.approx(1.0)
    assert stats["dead"].tolist() == [1.0, 0.0]
    # 8 copies per layer with k = 2: 4 tokens; confidence sums 2 and 3 -> 0.5 and 0.75
    metrics = load_metrics(counts, np.array([2.0, 3.0]), 2, [1, 2])
    assert metrics["max_vio/mean"] == 0.5 and metrics["max_vio/max"] == 1.0
    assert metrics["routing_confidence/mean"] == pytest.approx(0.625)
    assert metrics["expert_load/dead"] == 1.0 and metrics["expert_load/entropy/min"] == pytest.approx(0.75)
    assert metrics["expert_load/layer_1/cv"] == pytest.approx(math.sqrt(2) / 2)
    assert metrics["expert_load/layer_2/max_vio"] == 0.0


def test_bias_follows_the_sign_rule_exactly() -> None:
    model = glm_model()
    balancer = MoEBalancer(model, MoEBalanceConfig(coeff=0.01), None, max_steps=10)
    assert balancer.layers == [1, 2], "the first block is dense (first_k_dense_replace = 1)"
    counts = np.array([[9.0, 1.0, 3.0, 3.0, 0.0, 4.0, 4.0, 8.0], [4.0] * 8])  # means 4 and 4
    first = balancer.update(1, counts, np.ones(2))
    bias = model.moe_layers()[1].gate.e_score_correction_bias
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01, 0.01, 0.0, 0.0, -0.01])
    assert model.moe_layers()[2].gate.e_score_correction_bias.abs().sum() == 0, "a balanced layer stays put"
    assert first["moe/bias/flips"] == 0.0
    counts[0] = [0.0, 9.0, 3.0, 3.0, 8.0, 4.0, 4.0, 1.0]  # signs + - + + - 0 0 +: experts 0, 1, 4, 7 reverse
    second = balancer.update(2, counts, np.ones(2))
    assert second["moe/bias/flips"] == 4.0
    assert bias.tolist() == pytest.approx([0.0, 0.0, 0.02, 0.02, 0.0, 0.0, 0.0, 0.0])
    assert second["moe/bias/abs_mean"] == pytest.approx(0.04 / 16)


def test_override_and_freeze() -> None:
    model = glm_model()
    balancer = MoEBalancer(model, MoEBalanceConfig(coeff=0.5, freeze_at=0.5), 0.001, max_steps=10)
    assert balancer.coeff == 0.001, "the arch's load_balance_coeff wins"
    counts = np.array([[2.0, 0, 0, 0, 0, 0, 0, 0]] * 2)
    bias = model.moe_layers()[1].gate.e_score_correction_bias
    for step in range(1, 11):
        balancer.update(step, counts, np.ones(2))
        assert bias[0].item() == pytest.approx(-0.001 * min(step, 5)), f"updates stop after step 5 (step {step})"


def test_qwen3_moe_routers_are_measured_not_balanced() -> None:
    model = build_model(tiny_qwen3_moe(), 256, "sdpa", CPU)
    balancer = MoEBalancer(model, MoEBalanceConfig(), None, max_steps=4)
    metrics = balancer.update(1, np.array([[3.0, 1, 0, 0, 0, 0, 0, 0]] * 2), np.ones(2))
    assert "moe/bias/abs_mean" not in metrics and metrics["expert_load/dead"] == 12.0


def run_skewed(coeff: float, steps: int) -> list[float]:
    """A router pushed towards experts 0 and 1 for every token (all hidden states have a positive mean); only the
    selection bias moves. Each step routes 1024 fresh tokens and feeds their counts to the balancer."""
    torch.manual_seed(0)
    model = glm_model(layers=2)
    gate = model.moe_layers()[1].gate
    with torch.no_grad():
        gate.weight[:2] += 0.02
    balancer = MoEBalancer(model, MoEBalanceConfig(coeff=coeff), None, max_steps=steps)
    vio = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            routing = gate(torch.randn(1024, 64) + 1.0)
        counts = torch.bincount(routing.indices.reshape(-1), minlength=8).double().numpy()[None]
        confidence = np.array([routing.confidence.sum().item()])
        vio.append(balancer.update(step, counts, confidence)["max_vio/mean"])
    return vio


def test_balancing_repairs_a_skewed_router_and_no_balancing_does_not() -> None:
    off = run_skewed(0.0, 150)
    on = run_skewed(0.005, 150)
    assert off[0] == on[0] == 3.0, "experts 0 and 1 take every token at the start (max load = 4 x mean)"
    assert min(off) == 3.0, "without balancing the skew stays"
    assert max(on[-100:]) < 0.5, "within 50 steps balancing brings max_vio below 0.5, and it stays there"


def reference_seq_loss(scores: torch.Tensor, indices: torch.Tensor, doc_lens: list[int], k: int) -> torch.Tensor:
    """sum over segments of sum_i f_i P_i, one segment at a time with plain loops."""
    total = torch.zeros(())
    start = 0
    num_experts = scores.shape[1]
    for n in doc_lens:
        probs = scores[start : start + n] / scores[start : start + n].sum(-1, keepdim=True)
        chosen = indices[start : start + n]
        for i in range(num_experts):
            f = num_experts / (k * n) * float((chosen == i).sum())
            total = total + f * probs[:, i].mean()
        start += n
    return total


@pytest.mark.parametrize("arch", [tiny_glm(num_hidden_layers=2), tiny_qwen3_moe()], ids=["sigmoid", "softmax"])
def test_sequence_loss_matches_a_per_segment_loop_and_its_gradient_reaches_the_router(arch: object) -> None:
    from lmforge.model.attention import DocumentMask
    from lmforge.model.seq_balance import seq_balance_loss

    model = build_model(arch, 256, "sdpa", CPU)  # type: ignore[arg-type]
    init_weights(model, 0.02, 0, None, {})
    block = next(iter(model.moe_layers().values())).train()
    torch.manual_seed(1)
    x = torch.randn(40, 64)
    doc_lens = [7, 20, 13]
    mask = DocumentMask.from_doc_lens(torch.tensor(doc_lens), CPU)
    routing = block.gate(x)
    loss = seq_balance_loss(routing, mask.doc_ids, mask.cu_seqlens, 8)
    expected = reference_seq_loss(routing.scores, routing.indices, doc_lens, 2)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # Injected gradient == the gradient of the explicit objective (output term + coeff / segments x loss).
    weight = torch.randn(40, 64)
    scale = 0.3 / len(doc_lens)
    block.seq_aux = True
    block.aux_scale.fill_(scale)
    (block(x, mask) * weight).sum().backward()
    injected = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    block.seq_aux = False
    explicit = (block(x, mask) * weight).sum()
    explicit = explicit + scale * seq_balance_loss(block.gate(x), mask.doc_ids, mask.cu_seqlens, 8)
    explicit.backward()
    for name, p in block.named_parameters():
        torch.testing.assert_close(injected[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert injected["gate.weight"].abs().sum() > 0
