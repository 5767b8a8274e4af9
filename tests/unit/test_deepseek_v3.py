"""DeepSeek-V3: multi-head latent attention (both query paths, interleaved and half-split RoPE, YaRN's mscale on
every channel) and the MoE with group-limited routing give transformers' logits through export and import, cached
generation equals transformers' tokens, and the architecture's fields, roles and FLOPs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from lmforge.config.hf_config import read_hf_config
from lmforge.hf.weights import SINGLE_FILE, load_hf_weights
from lmforge.model import build_model
from lmforge.optim.groups import params_by_role
from lmforge.train.flops import FlopCounter
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
from tests.unit.test_moe import tiny_deepseek
from tests.unit.test_moe_export import random_hf_model
from tests.unit.test_rope_scaling import assert_greedy_equals_export

transformers = require("transformers")
CPU = torch.device("cpu")

ARCHS = {
    "q_proj-interleaved-yarn": tiny_deepseek(),
    "q_lora-halves": tiny_deepseek(q_lora_rank=24, rope_interleave=False, rope_scaling=None, attention_bias=True),
    "no-groups-tied": tiny_deepseek(n_group=1, topk_group=1, tie_word_embeddings=True, first_k_dense_replace=0),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_export_gives_transformers_logits_and_reads_back(name: str, tmp_path: Path) -> None:
    arch = ARCHS[name]
    model = _lmforge(arch)
    _export(model, tmp_path)
    hf = _from_pretrained(tmp_path)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ids = _ids(t=40)
    ours = _logits(model, ids, hf=False)
    torch.testing.assert_close(ours, _logits(hf, ids, hf=True), atol=1e-5, rtol=0)
    assert read_hf_config(tmp_path).arch == arch.model_copy(update={"num_key_value_heads": arch.num_attention_heads})


def test_the_rope_layout_and_mscale_are_in_what_both_compute(tmp_path: Path) -> None:
    arch = tiny_deepseek()
    model = _lmforge(arch)
    ids = _ids(t=40)
    ours = _logits(model, ids, hf=False)
    halves = build_model(arch.model_copy(update={"rope_interleave": False}), VOCAB, "sdpa", CPU).eval()
    halves.load_state_dict(model.state_dict())
    assert (_logits(halves, ids, hf=False) - ours).abs().max() > 1e-4
    for layer in halves.model.layers:
        layer.self_attn.interleave = True
        layer.self_attn.q_scale = 1.0  # the backends' 1 / sqrt(q width) alone
    assert (_logits(halves, ids, hf=False) - ours).abs().max() > 1e-4
    # the softmax scale is transformers' (DeepSeek's mscale(factor, mscale_all_dim)^2 on 1 / sqrt(q width))
    from transformers.modeling_rope_utils import yarn_apply_mscale

    want = yarn_apply_mscale(arch.rope_scaling.hf_parameters(), (16 + 8) ** -0.5)
    assert arch.softmax_scale == pytest.approx(want, rel=1e-12) and want != pytest.approx((16 + 8) ** -0.5)


def test_transformers_checkpoint_loads_and_exports_the_same(tmp_path: Path) -> None:
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256, num_mtp_layers=1,
    )  # fmt: skip
    hf = random_hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / SINGLE_FILE)
    info = read_hf_config(tmp_path / "hf")
    assert info.arch.model_type == "deepseek_v3" and info.arch.q_lora_rank == 24 and info.arch.rope_interleave
    # config.json announces an MTP module whose weights transformers does not save: the model has none
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert info.arch.num_nextn_predict_layers == 0
    model = build_model(info.arch, info.vocab_size, "sdpa", CPU).eval()
    load_hf_weights(model, tmp_path / "hf")
    ids = _ids(2)
    torch.testing.assert_close(_logits(model, ids, hf=False), _logits(hf, ids, hf=True), atol=1e-5, rtol=0)
    _export(model, tmp_path / "out")
    written = load_file(tmp_path / "out" / SINGLE_FILE)
    assert set(written) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(written[name], tensor), name


def test_config_has_the_keys_transformers_writes(tmp_path: Path) -> None:
    # Top-level copies are for transformers 4; transformers 5 folds them into rope_parameters.
    assert_config_like_transformers(tiny_deepseek(q_lora_rank=24), tmp_path, dropped=("rope_theta", "rope_scaling"))


def test_greedy_generation_equals_transformers(tmp_path: Path, one_thread: object) -> None:
    assert_greedy_equals_export(tiny_deepseek(), tmp_path, 24)


def test_documents_do_not_share_attention() -> None:
    assert_documents_attend_alone(_lmforge(tiny_deepseek()))


def test_low_rank_projections_are_hidden_matrices_and_flops_count_narrow_values() -> None:
    model = build_model(tiny_deepseek(q_lora_rank=24), VOCAB, "sdpa", CPU)
    roles = {name: role for role, params in params_by_role(model).items() for name, _ in params}
    attn = "model.layers.0.self_attn"
    for local in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert roles[f"{attn}.{local}.weight"] == "hidden", local
    assert roles[f"{attn}.o_proj.weight"] == "residual_out"
    assert roles[f"{attn}.q_a_layernorm.weight"] == roles[f"{attn}.kv_a_layernorm.weight"] == "norm"
    # per head and pair: 2 x 24 (q.k) + 2 x 12 (p.v) forward, x 3 with backward
    counter = FlopCounter(model, layers=3, heads=4, head_dim=24, value_dim=12)
    assert counter.per_pair == 3 * 4 * 3 * (2 * 24 + 2 * 12)


@pytest.mark.parametrize(
    ("change", "match"),
    [({"num_key_value_heads": 2}, "must equal num_attention_heads"),
     ({"head_dim": 32}, "head_dim is not a DeepSeek-V3 field"),
     ({"n_group": 3}, "n_group 3 equal groups")],
)  # fmt: skip
def test_field_errors(change: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        tiny_deepseek(**change)


def test_mscale_matches_its_formula() -> None:
    arch = tiny_deepseek()
    mscale = 0.1 * 0.8 * math.log(4.0) + 1
    assert arch.softmax_scale == pytest.approx(mscale**2 / math.sqrt(24), rel=1e-12)
    assert tiny_deepseek(rope_scaling=None).softmax_scale == pytest.approx(1 / math.sqrt(24), rel=1e-12)
