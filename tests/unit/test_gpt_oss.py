"""gpt-oss: logits equal to transformers' through export and import in its own checkpoint layout, greedy
generation, the clamped-SwiGLU experts with biases, the sinks and norms, and the parameters' roles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config.hf_config import HFModelError, arch_to_hf_config, read_hf_config
from lmforge.hf.weights import SINGLE_FILE, load_hf_weights
from lmforge.model import build_model
from lmforge.model.attention import resolve_backend
from lmforge.model.init import init_weights
from lmforge.model.moe import Experts, glu
from lmforge.model.norm import RMSNorm
from lmforge.optim.groups import params_by_role
from tests.conftest import require
from tests.unit.test_hf import (
    VOCAB,
    _export,
    _from_pretrained,
    _ids,
    _lmforge,
    _logits,
    assert_config_like_transformers,
    assert_documents_attend_alone,
)
from tests.unit.test_moe import tiny_gpt_oss
from tests.unit.test_moe_export import random_hf_model
from tests.unit.test_rope_scaling import assert_greedy_equals_export

transformers = require("transformers")
CPU = torch.device("cpu")


def test_export_gives_transformers_logits_and_reads_back(tmp_path: Path) -> None:
    arch = tiny_gpt_oss()
    model = _lmforge(arch)
    _export(model, tmp_path)
    saved = load_file(tmp_path / SINGLE_FILE)
    # gpt-oss's own layout: the router under mlp.router, stacked experts [E, H, 2I] and [E, I, H].
    assert saved["model.layers.0.mlp.router.bias"].shape == (4,)
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert saved["model.layers.0.mlp.experts.down_proj"].shape == (4, 32, 64)
    assert saved["model.layers.0.self_attn.sinks"].shape == (4,)
    hf = _from_pretrained(tmp_path)
    assert type(hf).__name__ == "GptOssForCausalLM"
    ids = _ids(t=40)
    ours = _logits(model, ids, hf=False)
    torch.testing.assert_close(ours, _logits(hf, ids, hf=True), atol=1e-5, rtol=0)
    # Each part is in what both compute: without the sinks, or with another clamp, the logits move.
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.zero_()
    assert (_logits(hf, ids, hf=True) - ours).abs().max() > 1e-3
    unclamped = build_model(arch.model_copy(update={"swiglu_limit": 100.0}), VOCAB, "sdpa", CPU).eval()
    unclamped.load_state_dict(model.state_dict())
    assert (_logits(unclamped, ids, hf=False) - ours).abs().max() > 1e-3
    back = read_hf_config(tmp_path).arch
    assert back == arch.model_copy(update={"layer_types": tuple(arch.block_attention)})


def test_transformers_checkpoint_loads_and_exports_the_same_tensors(tmp_path: Path) -> None:
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=6, max_position_embeddings=256,
                                       eos_token_id=[7, 8], swiglu_limit=0.5)  # fmt: skip
    hf = random_hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    info = read_hf_config(tmp_path / "hf")
    # transformers' defaults where config.json is silent on them, YaRN (factor 32, no truncation) among them.
    assert info.arch.rope_scaling is not None and info.arch.rope_scaling.truncate is False
    assert info.arch.attention_bias and info.arch.block_attention == ["sliding_attention", "full_attention"]
    model = build_model(info.arch, info.vocab_size, "sdpa", CPU).eval()
    load_hf_weights(model, tmp_path / "hf")
    ids = _ids(2)
    torch.testing.assert_close(_logits(model, ids, hf=False), _logits(hf, ids, hf=True), atol=1e-5, rtol=0)
    _export(model, tmp_path / "out")
    reference, written = load_file(tmp_path / "hf" / SINGLE_FILE), load_file(tmp_path / "out" / SINGLE_FILE)
    assert set(written) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(written[name], tensor), name


def test_config_has_the_keys_transformers_writes(tmp_path: Path) -> None:
    # Top-level copies are for transformers 4; transformers 5 folds them into rope_parameters.
    assert_config_like_transformers(tiny_gpt_oss(), tmp_path, dropped=("rope_theta", "rope_scaling"))


def test_greedy_generation_equals_transformers(tmp_path: Path, one_thread: object) -> None:
    # 8 + 24 positions: past the 5-key window, the sinks and the clamp in every step.
    assert_greedy_equals_export(tiny_gpt_oss(), tmp_path, 24)


def test_documents_do_not_share_windows_or_sinks() -> None:
    assert_documents_attend_alone(_lmforge(tiny_gpt_oss()))


def test_clamped_swiglu_equals_its_definition() -> None:
    alpha, limit = 1.702, 0.7
    gate = torch.linspace(-3, 3, 61, dtype=torch.float64).repeat(2)
    up = torch.linspace(-2, 2, 122, dtype=torch.float64)
    expected = []
    for g, u in zip(gate.tolist(), up.tolist(), strict=True):
        g, u = min(g, limit), max(-limit, min(u, limit))
        expected.append((u + 1) * g / (1 + torch.exp(torch.tensor(-alpha * g, dtype=torch.float64)).item()))
    got = glu(gate, up, "clamped_swiglu", (alpha, limit))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    # Past the clamp the output stops depending on its input.
    g = torch.tensor([2.0, 0.1], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([0.1, 5.0], dtype=torch.float64, requires_grad=True)
    glu(g, u, "clamped_swiglu", (alpha, limit)).sum().backward()
    assert g.grad is not None and u.grad is not None
    assert g.grad[0] == 0 and u.grad[1] == 0 and g.grad[1] != 0 and u.grad[0] != 0


def test_grouped_and_loop_experts_agree_with_biases() -> None:
    torch.manual_seed(0)
    experts = Experts(4, 16, 8, act="clamped_swiglu", betas=(1.702, 0.5), bias=True)
    with torch.no_grad():
        for param in experts.parameters():
            param.uniform_(-0.5, 0.5)
    x = torch.randn(12, 16)
    indices = torch.randint(0, 4, (12, 2))
    weights = torch.rand(12, 2)
    grads = {}
    for impl in ("grouped_mm", "loop"):
        experts.impl = impl  # type: ignore[assignment]
        experts.zero_grad()
        out, _ = experts(x, indices, weights)
        out.square().sum().backward()
        grads[impl] = (out.detach(), {n: p.grad.clone() for n, p in experts.named_parameters() if p.grad is not None})
    torch.testing.assert_close(grads["grouped_mm"][0], grads["loop"][0], atol=1e-6, rtol=0)
    assert set(grads["loop"][1]) == {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
    for name, grad in grads["loop"][1].items():
        torch.testing.assert_close(grads["grouped_mm"][1][name], grad, atol=1e-5, rtol=0)
    assert grads["loop"][1]["down_proj_bias"].abs().sum() > 0


def test_norm_scales_before_the_cast_like_transformers() -> None:
    torch.manual_seed(0)
    x = (torch.randn(64, 96) * 3).to(torch.bfloat16)
    norm = RMSNorm(96, 1e-5, scale_first=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    reference = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm(96, 1e-5)
    reference.weight.data.copy_(norm.weight)
    ours, theirs = norm(x), reference(x)
    assert ours.dtype == torch.bfloat16
    # At most one bf16 rounding step apart (the fp32 statistics are summed in another order).
    torch.testing.assert_close(ours.float(), theirs.float(), atol=0, rtol=2**-7)
    llama_order = RMSNorm(96, 1e-5)
    llama_order.weight.data.copy_(norm.weight)
    assert (llama_order(x) != ours).float().mean() > (theirs != ours).float().mean()


def test_sinks_and_biases_are_adamw_biases_initialized_at_zero() -> None:
    model = build_model(tiny_gpt_oss(), VOCAB, "sdpa", CPU)
    init_weights(model, 0.02, seed=0)
    roles = {name: role for role, params in params_by_role(model).items() for name, _ in params}
    biases = ("self_attn.sinks", "mlp.gate.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")
    for name in (f"model.layers.0.{local}" for local in biases):
        assert roles[name] == "bias", name
        assert torch.count_nonzero(model.get_parameter(name)) == 0, name
    assert roles["model.layers.0.mlp.experts.gate_up_proj"] == "expert_hidden"
    assert roles["model.layers.0.mlp.gate.weight"] == "router"
    counts = model.param_counts()
    # The expert biases are not matmul weights: 6 N D counts only the stacks.
    assert counts.active_matmul < counts.active_non_embedding + VOCAB * 64


def test_sinks_take_no_varlen_kernel() -> None:
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, sinks=True) == "flex"
    assert resolve_backend("auto", CPU, sinks=True) == "auto"
    # (torch's varlen kernel is importable without a GPU, so the check is the one about sinks.)
    with pytest.raises(ValueError, match="'varlen' cannot compute this architecture's attention sinks"):
        resolve_backend("varlen", cuda, sinks=True)


@pytest.mark.parametrize(
    ("changes", "match"),
    [({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config \\(mxfp4\\)"),
     ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types 'chunked_attention' at layer 1"),
     ({"sliding_window": None}, "sliding_window is None")],
    ids=["mxfp4", "layer-kind", "no-window"],
)  # fmt: skip
def test_unsupported_configs_name_file_and_field(changes: dict[str, object], match: str, tmp_path: Path) -> None:
    config = arch_to_hf_config(tiny_gpt_oss(num_hidden_layers=2), VOCAB, bos_id=None, eos_id=None, pad_id=None,
                               dtype="float32")  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(HFModelError, match=f"config.json: .*{match}"):
        read_hf_config(tmp_path)
