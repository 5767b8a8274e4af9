"""HF export and import: config.json mapping, safetensors shards, logits parity with transformers, FSDP2 loading."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config.arch import AnyArch, LlamaArch, Qwen3Arch
from lmforge.config.hf_config import (
    HFModelError,
    HFModelInfo,
    arch_to_hf_config,
    generation_config,
    read_hf_config,
)
from lmforge.hf.names import export_tensors
from lmforge.hf.weights import INDEX_FILE, SINGLE_FILE, load_hf_weights, write_safetensors
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.parallel.process_group import DistContext, init_distributed
from tests.conftest import require, tiny_llama, tiny_qwen3

transformers = require("transformers")

CPU = torch.device("cpu")
VOCAB = 256
ARCHS = [tiny_llama(), tiny_qwen3(), tiny_llama(tie_word_embeddings=True, head_dim=32), tiny_llama(attention_bias=True)]
ARCH_IDS = ["llama", "qwen3", "tied", "bias"]


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    # A process group of one, as a plain `lmforge train` starts.
    yield init_distributed()


def _lmforge(arch: AnyArch, vocab: int = VOCAB, seed: int = 3) -> CausalLM:
    model = build_model(arch, vocab, "sdpa", CPU)
    init_weights(model, 0.05, seed=seed)
    # Norm scales start at one and biases and sinks at zero; random ones catch a tensor loaded into the wrong slot.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif name.endswith(("bias", ".sinks")):
                param.copy_(torch.rand(param.shape, generator=gen) * 0.2 - 0.1)
    return model.eval()


def assert_config_like_transformers(arch: AnyArch, folder: Path, dropped: tuple[str, ...] = ()) -> None:
    """The config.json lmforge writes for `arch` equals the one transformers saves after reading it, but for the
    keys in `dropped` (top-level copies for transformers 4), and both read back to the same architecture."""
    ours = arch_to_hf_config(arch, VOCAB, bos_id=1, eos_id=2, pad_id=None, dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(ours))
    transformers.AutoConfig.from_pretrained(folder, local_files_only=True).save_pretrained(folder / "resaved")
    theirs = json.loads((folder / "resaved" / "config.json").read_text())
    theirs.pop("transformers_version")
    assert {k: v for k, v in ours.items() if k not in dropped} == theirs
    assert read_hf_config(folder / "resaved").arch == read_hf_config(folder).arch


def assert_documents_attend_alone(model: CausalLM) -> None:
    """A row packing two documents gives the second one the logits it has alone: no attention (window, sink or
    latent) reaches across a document's start."""
    ids = _ids(t=24)
    with torch.no_grad():
        packed = model(ids, torch.cat([torch.arange(10), torch.arange(14)])[None], torch.tensor([10, 14]))
        second = model(ids[:, 10:], torch.arange(14)[None], torch.tensor([14]))
    torch.testing.assert_close(packed[:, 10:], second, atol=1e-5, rtol=0)


def _export(model: CausalLM, folder: Path, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    config = arch_to_hf_config(model.arch, model.vocab_size, bos_id=1, eos_id=2, pad_id=0, dtype="float32")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(1, 2, 0)))
    return write_safetensors(export_tensors(model), folder, max_shard_bytes)


def _logits(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        if hf:
            return model(input_ids=ids).logits
        t = ids.shape[1]
        return model(ids, torch.arange(t)[None], torch.tensor([t], dtype=torch.int32))


def _ids(seed: int = 0, t: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


def _from_pretrained(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_export_loads_in_transformers_with_equal_logits(arch: LlamaArch | Qwen3Arch, tmp_path: Path) -> None:
    model = _lmforge(arch)
    assert _export(model, tmp_path) == [SINGLE_FILE]
    hf = _from_pretrained(tmp_path)
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if arch.model_type == "qwen3" else "LlamaForCausalLM")
    ids = _ids()
    diff = (_logits(model, ids, hf=False) - _logits(hf, ids, hf=True)).abs().max().item()
    assert diff <= 1e-4
    assert hf.config.tie_word_embeddings == arch.tie_word_embeddings
    assert hf.config.bos_token_id == 1 and hf.config.eos_token_id == 2 and hf.config.pad_token_id == 0


@pytest.mark.parametrize(
    "arch",
    [tiny_llama(rope_theta=5000.0), tiny_qwen3(),
     tiny_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64})],
    ids=["llama", "qwen3", "llama3-scaling"],
)  # fmt: skip
def test_config_has_the_keys_transformers_writes(arch: LlamaArch | Qwen3Arch, tmp_path: Path) -> None:
    ours = arch_to_hf_config(arch, VOCAB, bos_id=1, eos_id=2, pad_id=None, dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(ours))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    hf_config.save_pretrained(tmp_path / "resaved")
    theirs = json.loads((tmp_path / "resaved" / "config.json").read_text())
    theirs.pop("transformers_version")
    # The top-level rope_theta and rope_scaling are for transformers 4, which reads no rope_parameters; 5 folds
    # them into those.
    assert {k: v for k, v in ours.items() if k not in ("rope_theta", "rope_scaling")} == theirs
    assert ours.get("rope_scaling") == (
        None if arch.rope_scaling is None else {k: v for k, v in ours["rope_parameters"].items() if k != "rope_theta"}
    )
    assert ours["rope_theta"] == ours["rope_parameters"]["rope_theta"] == arch.rope_theta


def test_sharded_export_writes_an_index_and_loads_in_transformers(tmp_path: Path) -> None:
    model = _lmforge(tiny_qwen3())
    names = _export(model, tmp_path, max_shard_bytes=40_000)
    shards = names[:-1]
    assert len(shards) > 2 and names[-1] == INDEX_FILE and not (tmp_path / SINGLE_FILE).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    hf = _from_pretrained(tmp_path)
    ids = _ids(1)
    torch.testing.assert_close(_logits(model, ids, hf=False), _logits(hf, ids, hf=True), atol=1e-4, rtol=0)

    # Writing again as one file removes the shards, so loaders cannot mix old and new weights.
    assert _export(model, tmp_path) == [SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.glob("model*")) == [SINGLE_FILE]


def _hf_model(model_type: str, tied: bool, dtype: torch.dtype) -> torch.nn.Module:
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 20000.0,
        "tie_word_embeddings": tied,
        "bos_token_id": 5,
        "eos_token_id": [7, 8],
    }
    if model_type == "qwen3":
        config, cls = transformers.Qwen3Config(**fields), transformers.Qwen3ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**fields, attention_bias=True), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    hf = cls(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.uniform_(-0.1, 0.1)
    return hf.to(dtype).eval()


@pytest.mark.parametrize(
    ("model_type", "tied", "dtype"),
    [("llama", False, torch.float32), ("qwen3", True, torch.float32), ("qwen3", False, torch.bfloat16)],
    ids=["llama-bias", "qwen3-tied", "qwen3-bf16"],
)
def test_transformers_checkpoint_round_trip(model_type: str, tied: bool, dtype: torch.dtype, tmp_path: Path) -> None:
    hf = _hf_model(model_type, tied, dtype)
    hf.save_pretrained(tmp_path / "hf")

    info = read_hf_config(tmp_path / "hf")
    assert info.arch.model_type == model_type and info.arch.tie_word_embeddings == tied
    assert (info.vocab_size, info.bos_id, info.eos_id, info.pad_id) == (VOCAB, 5, 7, None)
    assert info.torch_dtype == str(dtype).removeprefix("torch.")
    assert info.arch.dim_per_head == 24 and info.arch.rope_theta == 20000.0 and info.arch.rms_norm_eps == 1e-5
    model = build_model(info.arch, info.vocab_size, "sdpa", CPU).to(dtype).eval()
    load_hf_weights(model, tmp_path / "hf")

    theirs = hf.state_dict()
    ours = model.state_dict()
    assert set(ours) == {k for k in theirs if "rotary_emb" not in k}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _ids(2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(_logits(model, ids, hf=False), _logits(hf, ids, hf=True), atol=tol, rtol=0)

    # And back out: the same tensors, bit for bit, under the same names.
    out = tmp_path / "out"
    out.mkdir()
    dtype_name = info.torch_dtype or "float32"
    config = arch_to_hf_config(info.arch, info.vocab_size, bos_id=5, eos_id=7, pad_id=None, dtype=dtype_name)
    (out / "config.json").write_text(json.dumps(config))
    state = model.state_dict()
    if tied:
        del state["lm_head.weight"]
    write_safetensors(state, out)
    original = load_file(tmp_path / "hf" / SINGLE_FILE)
    written = load_file(out / SINGLE_FILE)
    assert set(written) == set(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    again = read_hf_config(out)
    assert again == HFModelInfo(info.arch, VOCAB, 5, 7, None, dtype_name)


def test_fsdp_sharded_parameters_load(ctx: DistContext, tmp_path: Path) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    source = _lmforge(tiny_qwen3(tie_word_embeddings=True))
    _export(source, tmp_path, max_shard_bytes=60_000)
    model = build_model(tiny_qwen3(tie_word_embeddings=True), VOCAB, "sdpa", CPU)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    load_hf_weights(model, tmp_path)
    for name, tensor in source.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(dict(model.named_parameters())[name].full_tensor(), tensor), name


def write_hf_config(folder: Path, arch: AnyArch | None = None, **changes: object) -> Path:
    """The config.json of `arch` (the tiny Qwen3 by default) in `folder`, with `changes` applied (None: a key
    left out)."""
    config = arch_to_hf_config(arch or tiny_qwen3(), VOCAB, bos_id=None, eos_id=2, pad_id=None, dtype="float32")
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"model_type": "mistral"},
            r"'mistral' is not supported; supported: deepseek_v3, glm4_moe, gpt_oss, llama, lmforge_moe, qwen3, "
            r"qwen3_moe",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"mlp_bias": True}, r"mlp_bias"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"rope_scaling with rope_type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, r"rope_scaling.factor(.|\n)*required"),
        ({"use_sliding_window": True, "sliding_window": None}, r"use_sliding_window is true but sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types marks layer 1 sliding_attention"),
        ({"hidden_size": None}, r"required field\(s\) missing: hidden_size"),
        ({"num_key_value_heads": 3}, r"not a valid qwen3 architecture(.|\n)*multiple of"),
        ({"vocab_size": -1}, r"vocab_size"),
        ({"eos_token_id": "x"}, r"eos_token_id"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_unsupported_configs_name_file_and_field(changes: dict[str, object], match: str, tmp_path: Path) -> None:
    folder = write_hf_config(tmp_path, **changes)
    with pytest.raises(HFModelError, match=match) as err:
        read_hf_config(folder)
    assert str(folder / "config.json") in str(err.value)


def test_missing_config_and_folder(tmp_path: Path) -> None:
    with pytest.raises(HFModelError, match=r"config\.json: not found"):
        read_hf_config(tmp_path)
    with pytest.raises(HFModelError, match="no such model folder"):
        read_hf_config(tmp_path / "absent")


def test_config_defaults_and_eos_list(tmp_path: Path) -> None:
    # Absent fields mean what transformers' classes default to, not what lmforge defaults to.
    folder = write_hf_config(
        tmp_path,
        head_dim=None,
        rms_norm_eps=None,
        rope_parameters=None,
        rope_theta=None,
        max_position_embeddings=None,
        layer_types=None,
        dtype=None,
        eos_token_id=[9, 2],
        torch_dtype="bfloat16",
        extra_key="ignored",
    )
    info = read_hf_config(folder)
    assert info.arch.dim_per_head == 128 and info.arch.rms_norm_eps == 1e-6 and info.arch.rope_theta == 10000.0
    assert info.arch.max_position_embeddings == 32768
    assert info.eos_id == 9 and info.bos_id is None and info.torch_dtype == "bfloat16"
    # A transformers 4 config: the base only at the top level, rope_scaling of the default type.
    folder = write_hf_config(tmp_path / "v4", rope_parameters=None, rope_theta=5e5, rope_scaling={"type": "default"})
    assert read_hf_config(folder).arch.rope_theta == 5e5


def test_weight_errors_name_the_tensor(tmp_path: Path) -> None:
    source = _lmforge(tiny_llama())
    state = source.state_dict()
    target = _lmforge(tiny_llama(), seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    with pytest.raises(HFModelError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_hf_weights(target, tmp_path)

    partial = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_safetensors(partial, tmp_path / "missing")
    with pytest.raises(HFModelError, match=r"model needs: model\.layers\.1\.mlp\.up_proj\.weight$"):
        load_hf_weights(target, tmp_path / "missing")

    extra = {**state, "model.layers.0.extra.weight": torch.zeros(2), "model.rotary_emb.inv_freq": torch.zeros(8)}
    write_safetensors(extra, tmp_path / "extra")
    with pytest.raises(HFModelError, match=r"does not: model\.layers\.0\.extra\.weight$"):
        load_hf_weights(target, tmp_path / "extra")

    write_safetensors(_lmforge(tiny_llama(), vocab=VOCAB + 8).state_dict(), tmp_path / "shape", max_shard_bytes=50_000)
    with pytest.raises(HFModelError, match=r"model\.embed_tokens\.weight has shape \[264, 64\] .* \[256, 64\]"):
        load_hf_weights(target, tmp_path / "shape")
    # Every check runs before any copy: the failed loads changed nothing.
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), name

    # An untied model needs its own LM head; a tied one ignores a saved one.
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    write_safetensors(untied, tmp_path / "nohead")
    with pytest.raises(HFModelError, match=r"lm_head\.weight"):
        load_hf_weights(target, tmp_path / "nohead")
    tied = build_model(tiny_llama(tie_word_embeddings=True), VOCAB, "sdpa", CPU)
    write_safetensors(state, tmp_path / "tied")
    load_hf_weights(tied, tmp_path / "tied")
    assert torch.equal(tied.lm_head.weight, state["model.embed_tokens.weight"])
