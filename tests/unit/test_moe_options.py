"""The GLM-4.5 family's research options: gated attention, exclusive self attention (XSA) and null experts each
equal a direct per-token computation, their new parameters get gradients and init, null choices are counted apart,
and a model with options exports as `lmforge_moe` and loads back exactly (plain GLM-4.5 still exports as
`glm4_moe`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.config.arch import Glm4MoeArch
from lmforge.config.hf_config import RESEARCH_MODEL_TYPE, arch_to_hf_config, read_hf_config
from lmforge.hf.folder import load_pretrained
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import exclusive
from lmforge.model.moe import MoE
from lmforge.train.callbacks.balancing import load_metrics
from tests.unit.test_moe import tiny_glm
from tests.unit.test_moe_export import VOCAB, _export, _ids, _lmforge, _logits

CPU = torch.device("cpu")


def test_xsa_removes_each_heads_component_along_its_own_value() -> None:
    gen = torch.Generator().manual_seed(0)
    out, v = torch.randn(5, 4, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    got = exclusive(out, v)
    for t in range(5):
        for h in range(4):
            own = v[t, h // 2]  # 4 query heads read 2 KV heads
            want = out[t, h] - (out[t, h] @ own) / (own @ own) * own
            assert torch.allclose(got[t, h], want, atol=1e-6)
            assert abs(float(got[t, h] @ own)) < 1e-5
    assert torch.equal(exclusive(out, torch.zeros_like(v)), out)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_output_gate_and_xsa_equal_a_per_token_reference(gate: str) -> None:
    model = build_model(tiny_glm(attn_output_gate=gate, xsa=True), VOCAB, "sdpa", CPU)
    init_weights(model, 0.1, seed=1)
    attn = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(2)
    x, out, v = torch.randn(6, 64, generator=gen), torch.randn(6, 4, 16, generator=gen), torch.randn(6, 2, 16)
    got = attn.output(out, x, v)
    for t in range(6):
        heads = []
        for h in range(4):
            y = out[t, h] - (out[t, h] @ v[t, h // 2]) / (v[t, h // 2] @ v[t, h // 2]) * v[t, h // 2]
            rows = attn.g_proj.weight[h * 16 : (h + 1) * 16] if gate == "elementwise" else attn.g_proj.weight[h]
            heads.append(y * torch.sigmoid(rows @ x[t]))
        want = attn.o_proj(torch.cat(heads))
        assert torch.allclose(got[t], want, atol=1e-5)
    assert attn.g_proj.weight.shape == ((64 if gate == "elementwise" else 4), 64)


def _null_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen real experts one by one (null choices add nothing), plus the shared experts."""
    routing = moe.gate(x)
    out = moe.shared_experts(x)
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1])
        for slot in range(routing.indices.shape[1]):
            e = int(routing.indices[t, slot])
            if e >= moe.spec.num_experts:
                continue
            gate, up = F.linear(x[t], moe.experts.gate_up_proj[e]).chunk(2)
            total = total + routing.weights[t, slot] * F.linear(F.silu(gate) * up, moe.experts.down_proj[e])
        rows.append(total)
    return torch.stack(rows) + out


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_null_experts_equal_a_per_token_reference_and_are_counted_apart(impl: str) -> None:
    arch = tiny_glm(null_experts=3, num_experts_per_tok=3)
    model = build_model(arch, VOCAB, "sdpa", CPU)
    init_weights(model, 0.1, seed=4)
    moe = model.moe_layers()[1]
    moe.experts.impl = impl  # type: ignore[assignment]
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.6, 11))  # nulls (last 3) picked often
    moe.train()
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    got = moe(x)
    with torch.no_grad():
        want = _null_reference(moe, x)
    assert torch.allclose(got, want, atol=1e-5)
    routing = moe.gate(x)
    null = int((routing.indices >= 8).sum())
    assert 0 < null < routing.indices.numel()
    counts = moe.tokens_per_expert
    assert counts.shape == (11,) and int(counts[8:].sum()) == null and int(counts.sum()) == 60
    assert int(moe.experts.tokens_computed) == 60 - null
    got.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert moe.gate.weight.grad[8:].abs().sum() > 0  # the null experts' router rows learn through their gates
    metrics = load_metrics(counts[None, :8].numpy(), moe.routing_confidence_sum[None].numpy(), 3, [1],
                           counts[None, 8:].numpy())  # fmt: skip
    assert metrics["moe/null_share"] == pytest.approx(null / 60)
    assert metrics["moe/real_k"] == pytest.approx((60 - null) / 20)


def test_new_parameters_get_gradients_and_an_init() -> None:
    model = build_model(tiny_glm(attn_output_gate="headwise", xsa=True, null_experts=2), VOCAB, "sdpa", CPU)
    init_weights(model, 0.1, seed=0)  # an undeclared rule would raise
    names = [n for n, _ in model.named_parameters() if "g_proj" in n]
    assert names and all(p.abs().sum() > 0 for n, p in model.named_parameters() if "g_proj" in n)
    ids = _ids()
    model(ids, torch.arange(48)[None], torch.tensor([20, 28], dtype=torch.int32)).float().logsumexp(-1).sum().backward()
    for name, param in model.named_parameters():
        if "g_proj" in name or name.endswith("mlp.gate.weight"):
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_options_export_as_lmforge_moe_and_load_back_exactly(tmp_path: Path) -> None:
    plain = arch_to_hf_config(tiny_glm(), VOCAB, bos_id=None, eos_id=None, pad_id=None, dtype="float32")
    assert plain["model_type"] == "glm4_moe" and "xsa" not in plain
    arch = tiny_glm(attn_output_gate="elementwise", xsa=True, null_experts=2)
    model = _lmforge(arch)
    with torch.no_grad():
        for moe in model.moe_layers().values():  # a bias over routed and null experts
            moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 10))
    _export(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == RESEARCH_MODEL_TYPE and config["architectures"] == ["LmforgeMoeForCausalLM"]
    assert (config["attn_output_gate"], config["xsa"], config["null_experts"]) == ("elementwise", True, 2)
    assert read_hf_config(tmp_path).arch == arch.model_copy(update={"head_dim": 16})  # written explicitly
    back, _ = load_pretrained(tmp_path)
    assert torch.equal(_logits(back, _ids(), hf=False), _logits(model, _ids(), hf=False))
    assert isinstance(back.arch, Glm4MoeArch) and back.arch.research_options == ["attn_output_gate", "xsa",
                                                                                  "null_experts"]  # fmt: skip


def _latent_reference(moe: MoE, x: torch.Tensor, situ: tuple[float, float] | None) -> torch.Tensor:
    """LatentMoE token by token from its definition: z = W_down x, the chosen experts' gated sum on z, W_up of it,
    plus the shared experts on x; each expert a SwiGLU or, with `situ` = (b1, b2), a SiTU-GLU."""
    routing = moe.gate(x)
    down, up_proj = moe.latent_down_proj.weight, moe.latent_up_proj.weight
    rows = []
    for t in range(x.shape[0]):
        z = down @ x[t]
        total = torch.zeros(z.shape[0])
        for slot in range(routing.indices.shape[1]):
            e = int(routing.indices[t, slot])
            g, u = (moe.experts.gate_up_proj[e] @ z).chunk(2)
            if situ is None:
                act = g * torch.sigmoid(g) * u
            else:
                b1, b2 = situ
                act = b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)
            total = total + routing.weights[t, slot] * (moe.experts.down_proj[e] @ act)
        rows.append(up_proj @ total)
    return torch.stack(rows) + moe.shared_experts(x)


@pytest.mark.parametrize("glu", ["swiglu", "situ_glu"])
@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_latent_experts_equal_a_per_token_reference(impl: str, glu: str) -> None:
    arch = tiny_glm(moe_latent_size=16, expert_glu=glu, situ_beta=0.5, situ_linear_beta=0.8)  # caps that bite
    model = build_model(arch, VOCAB, "sdpa", CPU)
    init_weights(model, 0.2, seed=6)
    moe = model.moe_layers()[1]
    moe.experts.impl = impl  # type: ignore[assignment]
    assert moe.experts.gate_up_proj.shape == (8, 64, 16) and moe.experts.down_proj.shape == (8, 16, 32)
    assert moe.latent_down_proj.weight.shape == (16, 64) and moe.latent_up_proj.weight.shape == (64, 16)
    moe.train()
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(7), requires_grad=True)
    got = moe(x)
    with torch.no_grad():
        want = _latent_reference(moe, x, (0.5, 0.8) if glu == "situ_glu" else None)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert int(moe.tokens_per_expert.sum()) == 40 and int(moe.experts.tokens_computed) == 40
    got.square().sum().backward()
    for param in (moe.latent_down_proj.weight, moe.latent_up_proj.weight, moe.gate.weight, moe.experts.gate_up_proj):
        assert param.grad is not None and param.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_situ_glu_caps_both_factors() -> None:
    from lmforge.model.moe import glu

    big = torch.tensor([1e4, -1e4, 0.0])
    assert torch.allclose(glu(big, big, "situ_glu", (4.0, 25.0)), torch.tensor([100.0, 0.0, 0.0]))
    small = torch.tensor([1e-3, -2e-3])  # near zero, SiTU-GLU is SwiGLU to first order
    assert torch.allclose(glu(small, small, "situ_glu"), glu(small, small), rtol=1e-3)


def test_latent_dispatch_sends_latent_rows() -> None:
    widths: list[int] = []

    def exchange(xs: torch.Tensor, counts: torch.Tensor, compute: Callable[..., torch.Tensor]) -> torch.Tensor:
        widths.append(xs.shape[-1])  # what the all-to-all would send
        return compute(xs, counts)

    model = build_model(tiny_glm(moe_latent_size=16), VOCAB, "sdpa", CPU)
    init_weights(model, 0.1, seed=0)
    moe = model.moe_layers()[1]
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    plain = moe(x)
    moe.experts.exchange = exchange  # stacks left whole: only the exchange path is taken
    assert torch.equal(moe(x), plain) and widths == [16]


def test_latent_projections_have_roles_an_init_and_count_as_active() -> None:
    from lmforge.model.params import count_params
    from lmforge.model.roles import param_role

    model = build_model(tiny_glm(moe_latent_size=16), VOCAB, "sdpa", CPU)
    init_weights(model, 0.1, seed=0)
    params = dict(model.named_parameters())
    down, up = "model.layers.1.mlp.latent_down_proj.weight", "model.layers.1.mlp.latent_up_proj.weight"
    assert param_role(down, 2) == "hidden" and param_role(up, 2) == "residual_out"
    assert params[down].std() > 0.05 and params[up].std() > 0.05  # drawn like any block matrix (std 0.1)
    share = 2 / 8
    want = sum(p.numel() * (share if ".mlp.experts." in n else 1.0) for n, p in params.items() if "embed" not in n)
    assert count_params(model).active_non_embedding == pytest.approx(want)


def test_latent_size_must_be_below_the_hidden_size() -> None:
    with pytest.raises(ValueError, match="moe_latent_size 64 must be below hidden_size 64"):
        tiny_glm(moe_latent_size=64)


def test_latent_and_situ_experts_export_as_lmforge_moe_and_load_back_exactly(tmp_path: Path) -> None:
    arch = tiny_glm(moe_latent_size=16, expert_glu="situ_glu", situ_beta=2.0, situ_linear_beta=3.0)
    model = _lmforge(arch)
    _export(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == RESEARCH_MODEL_TYPE
    assert (config["moe_latent_size"], config["expert_glu"], config["situ_beta"], config["situ_linear_beta"]) == (
        16, "situ_glu", 2.0, 3.0)  # fmt: skip
    assert read_hf_config(tmp_path).arch == arch.model_copy(update={"head_dim": 16})
    back, _ = load_pretrained(tmp_path)
    assert torch.equal(_logits(back, _ids(), hf=False), _logits(model, _ids(), hf=False))
    assert back.arch.research_options == ["moe_latent_size", "expert_glu"]


def test_bias_on_logits_chooses_by_biased_logits_and_gates_by_unbiased_scores() -> None:
    model = build_model(tiny_glm(router_bias_on_logits=True, routed_scaling_factor=1.0), VOCAB, "sdpa", CPU)
    init_weights(model, 0.2, seed=4)
    gate = model.moe_layers()[1].gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.linspace(-1.0, 1.0, 8))
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(5))
    routing = gate(x)
    logits = x @ gate.weight.detach().T
    for t in range(30):
        order = sorted(range(8), key=lambda e: -float(logits[t, e] + gate.e_score_correction_bias[e]))
        assert sorted(routing.indices[t].tolist()) == sorted(order[:2])
        chosen = torch.sigmoid(logits[t, routing.indices[t]])
        assert torch.allclose(routing.weights[t], chosen / chosen.sum(), atol=1e-6)
    # The same bias on the scores picks differently: the logits' scale is not the scores'.
    on_scores = build_model(tiny_glm(routed_scaling_factor=1.0), VOCAB, "sdpa", CPU)
    on_scores.load_state_dict(model.state_dict())
    assert not torch.equal(on_scores.moe_layers()[1].gate(x).indices.sort(-1).values, routing.indices.sort(-1).values)
