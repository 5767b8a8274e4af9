"""MoE models and HF: config.json and safetensors that transformers loads with equal logits, and HF checkpoints
(per-expert or stacked experts) loaded back into lmforge."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmforge.config.arch import Glm4MoeArch, Qwen3MoeArch
from lmforge.config.hf_config import HFModelError, arch_to_hf_config, read_hf_config
from lmforge.hf.names import export_tensors
from lmforge.hf.weights import SINGLE_FILE, load_hf_weights, write_safetensors
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.parallel.process_group import DistContext, init_distributed
from tests.conftest import require
from tests.unit.test_hf import write_hf_config
from tests.unit.test_moe import tiny_glm, tiny_qwen3_moe

transformers = require("transformers")

CPU = torch.device("cpu")
VOCAB = 256
Arch = Glm4MoeArch | Qwen3MoeArch


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def _lmforge(arch: Arch, seed: int = 3) -> CausalLM:
    model = build_model(arch, VOCAB, "sdpa", CPU)
    init_weights(model, 0.05, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith(".bias"):
                param.uniform_(-0.1, 0.1, generator=gen)
        # A learned selection bias, large enough to change which experts tokens pick.
        for moe in model.moe_layers().values():
            if moe.spec.selection_bias:
                bias = moe.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.numel(), generator=gen) * 0.2)
    return model.eval()


def _export(model: CausalLM, folder: Path, dtype: str = "float32") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = arch_to_hf_config(model.arch, VOCAB, bos_id=1, eos_id=2, pad_id=0, dtype=dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(export_tensors(model, getattr(torch, dtype)), folder)


def _logits(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        if hf:
            return model(input_ids=ids).logits
        t = ids.shape[1]
        return model(ids, torch.arange(t)[None], torch.tensor([t], dtype=torch.int32))


def _ids(seed: int = 0, t: int = 48) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


def _from_pretrained(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()


ARCHS = [tiny_glm(), tiny_glm(tie_word_embeddings=True, n_shared_experts=2, norm_topk_prob=False), tiny_qwen3_moe(),
         tiny_glm(n_group=4, topk_group=2)]  # fmt: skip
ARCH_IDS = ["glm", "glm-tied", "qwen3_moe", "glm-groups"]


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_export_loads_in_transformers_with_equal_logits(arch: Arch, tmp_path: Path) -> None:
    model = _lmforge(arch)
    _export(model, tmp_path)
    names = set(load_file(tmp_path / SINGLE_FILE))
    # Experts are stored per expert, the layout every transformers version and inference engine reads.
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    hf = _from_pretrained(tmp_path)
    assert type(hf).__name__ == {"glm4_moe": "Glm4MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch.model_type]
    ids = _ids()
    ours = _logits(model, ids, hf=False)
    torch.testing.assert_close(ours, _logits(hf, ids, hf=True), atol=1e-4, rtol=0)
    if arch.model_type == "glm4_moe":
        # The learned bias is part of what transformers computes: without it the logits move.
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
        assert (_logits(hf, ids, hf=True) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("arch", [tiny_glm(rope_theta=5000.0, partial_rotary_factor=0.25), tiny_qwen3_moe()],
                         ids=["glm", "qwen3_moe"])  # fmt: skip
def test_config_has_the_keys_transformers_writes(arch: Arch, tmp_path: Path) -> None:
    ours = arch_to_hf_config(arch, VOCAB, bos_id=1, eos_id=2, pad_id=None, dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(ours))
    transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True).save_pretrained(tmp_path / "resaved")
    theirs = json.loads((tmp_path / "resaved" / "config.json").read_text())
    theirs.pop("transformers_version")
    # Top-level copies are for transformers 4 (5 folds them into rope_parameters); transformers 5 saves
    # Qwen3-MoE's num_experts under its attribute-mapped name.
    expected = {k: v for k, v in ours.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if "num_experts" in expected:
        expected["num_local_experts"] = expected.pop("num_experts")
    assert expected == theirs
    assert read_hf_config(tmp_path / "resaved").arch == read_hf_config(tmp_path).arch


def test_bf16_export_keeps_the_biased_router_in_fp32(tmp_path: Path) -> None:
    model = _lmforge(tiny_glm())
    _export(model, tmp_path, dtype="bfloat16")
    with safe_open(str(tmp_path / SINGLE_FILE), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight").dtype == torch.bfloat16
    hf = _from_pretrained(tmp_path, torch.bfloat16)
    # transformers keeps the router in fp32 too, so it routes with exactly the trained values.
    for i in (1, 2):
        ours, theirs = model.model.layers[i].mlp.gate, hf.model.layers[i].mlp.gate
        assert torch.equal(theirs.weight, ours.weight) and torch.equal(
            theirs.e_score_correction_bias, ours.e_score_correction_bias
        )


def _hf_model(model_type: str) -> torch.nn.Module:
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 20000.0, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
              "bos_token_id": 5, "eos_token_id": [7, 8]}  # fmt: skip
    if model_type == "glm4_moe":
        glm = {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "attention_bias": True,
               "use_qk_norm": True, "routed_scaling_factor": 1.5}  # fmt: skip
        config = transformers.Glm4MoeConfig(**common, **glm)
    else:
        config = transformers.Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=True)
    return random_hf_model(config)


def random_hf_model(config: object) -> torch.nn.Module:
    """A transformers model of `config` with every weight and selection bias drawn from U(-0.1, 0.1), in eval mode."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.uniform_(-0.1, 0.1)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.1, 0.1)
    return hf.eval()


@pytest.mark.parametrize(
    ("model_type", "original_format"),
    [("glm4_moe", True), ("glm4_moe", False), ("qwen3_moe", True), ("qwen3_moe", False)],
    ids=["glm-per-expert", "glm-stacked", "qwen3_moe-per-expert", "qwen3_moe-stacked"],
)
def test_transformers_checkpoint_round_trip(model_type: str, original_format: bool, tmp_path: Path) -> None:
    hf = _hf_model(model_type)
    hf.save_pretrained(tmp_path / "hf", save_original_format=original_format)
    saved = load_file(tmp_path / "hf" / SINGLE_FILE)
    assert any(".experts.0." in name for name in saved) == original_format

    info = read_hf_config(tmp_path / "hf")
    assert info.arch.model_type == model_type and info.arch.dim_per_head == 24 and info.arch.rope_theta == 20000.0
    assert (info.vocab_size, info.bos_id, info.eos_id) == (VOCAB, 5, 7)
    model = build_model(info.arch, info.vocab_size, "sdpa", CPU).eval()
    load_hf_weights(model, tmp_path / "hf")
    theirs = hf.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids = _ids(2)
    torch.testing.assert_close(_logits(model, ids, hf=False), _logits(hf, ids, hf=True), atol=1e-5, rtol=0)

    # And back out in the per-expert layout transformers itself saves by default.
    _export(model, tmp_path / "out")
    reference = saved if original_format else load_file(_resave(hf, tmp_path / "hf_original") / SINGLE_FILE)
    written = load_file(tmp_path / "out" / SINGLE_FILE)
    assert set(written) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(written[name], tensor), name


def _resave(hf: torch.nn.Module, folder: Path) -> Path:
    hf.save_pretrained(folder)
    return folder


def test_glm_multi_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    model = _lmforge(tiny_glm())
    _export(model, tmp_path)
    tensors = load_file(tmp_path / SINGLE_FILE)
    # GLM-4.5 checkpoints store their MTP module as the layer after the last one.
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / SINGLE_FILE)
    target = build_model(tiny_glm(), VOCAB, "sdpa", CPU)
    load_hf_weights(target, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_weight_errors_name_the_expert_tensor(tmp_path: Path) -> None:
    model = _lmforge(tiny_qwen3_moe())
    tensors = export_tensors(model)
    target = _lmforge(tiny_qwen3_moe(), seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    write_safetensors({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"},
                      tmp_path / "missing")  # fmt: skip
    with pytest.raises(HFModelError, match=r"model needs: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight$"):
        load_hf_weights(target, tmp_path / "missing")

    wrong = {**tensors, "model.layers.0.mlp.experts.5.down_proj.weight": torch.zeros(64, 16)}
    write_safetensors(wrong, tmp_path / "shape")
    match = r"experts\.5\.down_proj\.weight has shape \[64, 16\] .* \[64, 32\] in the model \(as part of model\."
    with pytest.raises(HFModelError, match=match + r"layers\.0\.mlp\.experts\.down_proj\)"):
        load_hf_weights(target, tmp_path / "shape")
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_fsdp_sharded_moe_loads(ctx: DistContext, tmp_path: Path) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    source = _lmforge(tiny_glm())
    _export(source, tmp_path)
    model = build_model(tiny_glm(), VOCAB, "sdpa", CPU, meta=True)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    model.to_empty(device=CPU)
    assert isinstance(model.model.layers[1].mlp.experts.gate_up_proj, DTensor)
    load_hf_weights(model, tmp_path)
    params = dict(model.named_parameters())
    for name, tensor in source.state_dict().items():
        got = params[name].full_tensor() if name in params else model.get_buffer(name)
        assert torch.equal(got, tensor), name
    assert model.moe_layers()[1].tokens_per_expert.sum() == 0, "loading zeroes the statistics"


@pytest.mark.parametrize(
    ("arch", "changes", "match"),
    [
        (tiny_glm(), {"n_group": 8, "topk_group": 4}, r"glm4_moe(.|\n)*n_group 8 equal groups of at least 2"),
        (tiny_qwen3_moe(), {"mlp_only_layers": [0]}, r"qwen3_moe(.|\n)*mlp_only_layers \[0\] is not supported"),
        (tiny_qwen3_moe(), {"decoder_sparse_step": 2}, r"decoder_sparse_step 2"),
        (tiny_qwen3_moe(), {"use_sliding_window": True}, r"use_sliding_window"),
        (tiny_qwen3_moe(), {"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 is not supported"),
        (tiny_glm(), {"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ],
    ids=["groups", "mlp-only", "sparse-step", "sliding", "qwen-partial-rope", "act"],
)
def test_unsupported_configs_name_file_and_field(arch: Arch, changes: dict[str, object], match: str,
                                                 tmp_path: Path) -> None:  # fmt: skip
    folder = write_hf_config(tmp_path, arch, **changes)
    with pytest.raises(HFModelError, match=match) as err:
        read_hf_config(folder)
    assert str(folder / "config.json") in str(err.value)


def test_absent_fields_take_transformers_defaults(tmp_path: Path) -> None:
    drop = dict.fromkeys(("n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "partial_rotary_factor",
                          "rope_parameters", "head_dim", "num_nextn_predict_layers"))  # fmt: skip
    glm = read_hf_config(write_hf_config(tmp_path / "glm", tiny_glm(n_shared_experts=2), **drop)).arch
    assert isinstance(glm, Glm4MoeArch)
    assert (glm.n_shared_experts, glm.first_k_dense_replace, glm.norm_topk_prob) == (1, 1, True)
    assert glm.partial_rotary_factor == 0.5 and glm.head_dim is None and glm.load_balance_coeff is None
    qwen = read_hf_config(write_hf_config(tmp_path / "qwen", tiny_qwen3_moe(), num_experts=None, num_local_experts=6,
                                        norm_topk_prob=None, head_dim=None))  # fmt: skip
    assert isinstance(qwen.arch, Qwen3MoeArch)
    assert (qwen.arch.num_experts, qwen.arch.norm_topk_prob, qwen.arch.head_dim) == (6, False, None)
