"""RoPE scaling (linear, Llama 3.1, YaRN): the tables equal transformers' for the same config.json, exported models
give transformers' logits and greedy tokens, HF configs read back to the same architecture, bad fields are named."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from lmforge.config.arch import AnyArch, LlamaArch
from lmforge.config.hf_config import HFModelError, arch_to_hf_config, read_hf_config
from lmforge.config.rope import RopeScaling
from lmforge.model.generate import generate
from lmforge.model.rope_scaling import rotary_frequencies
from lmforge.model.rotary import rotary_cos_sin
from tests.conftest import require, tiny_llama, tiny_qwen3
from tests.unit.test_hf import VOCAB, _export, _from_pretrained, _ids, _lmforge, _logits
from tests.unit.test_moe import tiny_glm

transformers = require("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.3, "truncate": False},
}
# Small bases make every regime of the ramps (kept, blended, divided) appear over a short original context.
BASES = {"linear": 10000.0, "llama3": 500.0, "yarn": 300.0, "yarn-mscale": 300.0, "yarn-attention-factor": 300.0}


def _hf_tables(arch: AnyArch, positions: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of transformers' rotary embedding, built from the config.json lmforge exports."""
    config = arch_to_hf_config(arch, VOCAB, bos_id=None, eos_id=None, pad_id=None, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    model_cls = transformers.AutoModelForCausalLM.from_config(hf_config)
    rotary = model_cls.model.rotary_emb
    x = torch.zeros(1, positions.numel(), 1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_equal_transformers(name: str, tmp_path: Path) -> None:
    arch = tiny_llama(head_dim=32, rope_theta=BASES[name], rope_scaling=SCALINGS[name])
    positions = torch.arange(64)
    ours = rotary_cos_sin(positions, arch, torch.float32)
    theirs = _hf_tables(arch, positions, tmp_path)
    torch.testing.assert_close(ours, theirs, atol=2e-7, rtol=0)
    plain = rotary_cos_sin(positions, arch.model_copy(update={"rope_scaling": None}), torch.float32)
    assert (ours[0] - plain[0]).abs().max() > 1e-2, "the scaling changed nothing: the comparison proves little"


def test_partial_rotary_yarn_equals_transformers(tmp_path: Path) -> None:
    # GLM-4.5 turns half of each head: the frequencies are those of the rotary width.
    arch = tiny_glm(rope_theta=300.0, rope_scaling=YARN)
    positions = torch.arange(40)
    assert arch.rotary_dim == 8
    torch.testing.assert_close(rotary_cos_sin(positions, arch, torch.float32), _hf_tables(arch, positions, tmp_path),
                               atol=2e-7, rtol=0)  # fmt: skip


def test_each_regime_of_the_llama3_rule() -> None:
    # Written from the rule: kept above 4 turns over the original context, divided below 1, blended in between.
    arch = tiny_llama(head_dim=32, rope_theta=500.0, rope_scaling=LLAMA3)
    scaled, factor = rotary_frequencies(arch, torch.device("cpu"))
    plain, _ = rotary_frequencies(arch.model_copy(update={"rope_scaling": None}), torch.device("cpu"))
    assert factor == 1.0
    turns = 64 * plain / (2 * math.pi)
    kept, divided = turns > 4, turns < 1
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    torch.testing.assert_close(scaled[kept], plain[kept])
    torch.testing.assert_close(scaled[divided], plain[divided] / 8)
    middle = ~kept & ~divided
    weight = (turns[middle] - 1) / 3
    torch.testing.assert_close(scaled[middle], (1 - weight) * plain[middle] / 8 + weight * plain[middle])


def test_yarn_attention_factor_from_the_definition() -> None:
    arch = tiny_llama(rope_scaling=YARN)
    _, factor = rotary_frequencies(arch, torch.device("cpu"))
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1)
    cos, sin = rotary_cos_sin(torch.arange(5), arch, torch.float64)
    torch.testing.assert_close(cos.square() + sin.square(), torch.full_like(cos, factor**2))


@pytest.mark.parametrize(
    ("arch", "name"),
    [(tiny_llama(rope_theta=500.0, rope_scaling=LLAMA3), "llama-llama3"),
     (tiny_qwen3(rope_theta=300.0, rope_scaling=YARN), "qwen3-yarn"),
     (tiny_llama(rope_scaling=SCALINGS["linear"]), "llama-linear")],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_export_gives_transformers_logits_and_reads_back(arch: AnyArch, name: str, tmp_path: Path) -> None:
    model = _lmforge(arch)
    _export(model, tmp_path)
    hf = _from_pretrained(tmp_path)
    ids = _ids(t=48)  # three times YaRN's 16-token original context
    diff = (_logits(model, ids, hf=False) - _logits(hf, ids, hf=True)).abs().max().item()
    assert diff <= 1e-5, name
    assert read_hf_config(tmp_path).arch == arch.model_copy(update={"head_dim": arch.dim_per_head})


def assert_greedy_equals_export(arch: AnyArch, folder: Path, new_tokens: int) -> None:
    """Greedy tokens of lmforge's KV-cached generation equal transformers' on the exported model."""
    model = _lmforge(arch)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4)  # larger weights: a continuation that is not one token repeated
    _export(model, folder)
    hf = _from_pretrained(folder)
    prompt = _ids(seed=1, t=8)
    ours = list(generate(model, prompt[0].tolist(), new_tokens, temperature=0.0, eos_id=None))
    out = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                      generation_config=transformers.GenerationConfig())  # fmt: skip
    assert len(set(ours)) > 1, "degenerate continuation: the comparison would prove little"
    assert ours == out[0, 8:].tolist()


def test_greedy_generation_equals_transformers_with_yarn(tmp_path: Path, one_thread: object) -> None:
    assert_greedy_equals_export(tiny_qwen3(rope_theta=300.0, rope_scaling=YARN), tmp_path, 30)


def _write(folder: Path, **changes: object) -> Path:
    config = arch_to_hf_config(tiny_llama(max_position_embeddings=64), VOCAB, bos_id=None, eos_id=None, pad_id=None,
                               dtype="float32")  # fmt: skip
    config.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_hf_configs_of_both_transformers_versions(tmp_path: Path) -> None:
    # transformers 4: `rope_scaling` with the old `type` key; a YaRN factor left out is the ratio of the lengths.
    scaling_v4 = {"type": "yarn", "original_max_position_embeddings": 16}
    old = _write(tmp_path / "v4", rope_parameters=None, rope_scaling=scaling_v4)
    scaling = read_hf_config(old).arch.rope_scaling
    assert scaling is not None and scaling.rope_type == "yarn" and scaling.factor == 4.0
    # transformers 5: everything in `rope_parameters`; a top-level pretraining length wins, as there.
    new = _write(tmp_path / "v5", rope_parameters={"rope_theta": 1e4, **LLAMA3}, original_max_position_embeddings=32)
    scaling = read_hf_config(new).arch.rope_scaling
    assert scaling is not None and scaling.rope_type == "llama3" and scaling.original_max_position_embeddings == 32
    # Left out, the pretraining length is max_position_embeddings (transformers' standardization).
    bare = _write(tmp_path / "bare", rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 2.0})
    scaling = read_hf_config(bare).arch.rope_scaling
    assert scaling is not None and scaling.original_max_position_embeddings == 64


@pytest.mark.parametrize(
    ("rope", "match"),
    [({"rope_type": "dynamic", "factor": 2.0}, r"rope_type 'dynamic' is not supported"),
     ({"rope_type": "longrope", "short_factor": [1.0]}, r"rope_type 'longrope' is not supported"),
     ({"rope_type": "linear", "factor": 2.0, "beta_fast": 8}, r"beta_fast are not supported for rope_type 'linear'"),
     ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 4.0,
       "high_freq_factor": 1.0}, r"high_freq_factor 1.0 must exceed low_freq_factor 4.0")],
    ids=["dynamic", "longrope", "stray-field", "llama3-factors"],
)  # fmt: skip
def test_unsupported_hf_scalings_name_file_and_field(rope: dict[str, object], match: str, tmp_path: Path) -> None:
    folder = _write(tmp_path, rope_parameters={"rope_theta": 1e4, **rope})
    with pytest.raises(HFModelError, match=match) as err:
        read_hf_config(folder)
    assert str(folder / "config.json") in str(err.value)


def test_toml_tables_and_their_errors() -> None:
    text = """
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 2
    num_attention_heads = 4
    [rope_scaling]
    rope_type = "yarn"
    factor = 4.0
    original_max_position_embeddings = 4096
    """
    arch = LlamaArch(**tomllib.loads(text))
    assert arch.rope_scaling is not None and arch.rope_scaling.beta_fast == 32.0 and arch.rope_scaling.truncate
    # transformers 5's one table: the base and the scaling split into their fields.
    same = LlamaArch(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     rope_parameters={"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 4096})  # fmt: skip
    assert same.rope_theta == 5e5 and same.rope_scaling == arch.rope_scaling
    # A dump of the whole table (as a run's config.toml holds it) validates again: other kinds' fields at defaults.
    assert LlamaArch(**arch.model_dump()) == arch
    bad = [
        ({"rope_type": "linear", "factor": 2.0, "mscale": 1.0}, r"mscale do not apply to rope_type 'linear'"),
        ({"rope_type": "yarn", "factor": 2.0}, r"original_max_position_embeddings is required for 'yarn'"),
        ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8}, r"factor"),
        ({"rope_type": "ntk", "factor": 2.0}, r"rope_type"),
    ]
    for scaling, match in bad:
        with pytest.raises(ValidationError, match=match):
            tiny_llama(rope_scaling=scaling)
    with pytest.raises(ValidationError, match=r"rope_parameters.rope_theta 500000.0 contradicts rope_theta 10000.0"):
        tiny_llama(rope_theta=1e4, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    with pytest.raises(ValidationError, match=r"not both"):
        tiny_llama(rope_scaling=YARN, rope_parameters={"rope_type": "linear", "factor": 2.0})


def test_model_rope_scaling_extends_a_pretrained_folder(tmp_path: Path) -> None:
    from lmforge.config import ConfigError, load_train_config
    from lmforge.hf.folder import write_model_files

    folder = tmp_path / "pretrained"
    write_model_files(folder, tiny_llama(max_position_embeddings=128), VOCAB, None)
    base = ["--data.type", "fake", "--data.vocab_size", str(VOCAB), "--data.seq_len", "512",
            "--data.batch_tokens", "1024", "--data.micro_batch_tokens", "1024", "--output_dir", str(tmp_path / "run"),
            "--max_steps", "1", "--optim.type", "adamw", "--optim.lr", "1e-3"]  # fmt: skip
    scaling = ["--model.rope_scaling.rope_type", "yarn", "--model.rope_scaling.factor", "4",
               "--model.rope_scaling.original_max_position_embeddings", "128"]  # fmt: skip
    config, _ = load_train_config([*base, "--model.name", str(folder), *scaling])
    assert config.model.arch is not None and config.model.arch.max_position_embeddings == 512
    assert config.model.arch.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=128)  # fmt: skip
    # Without the scaling, the folder's 128 positions cannot take 512-token windows.
    with pytest.raises(ConfigError, match=r"data.seq_len.*512 exceeds model.arch.max_position_embeddings \(128\)"):
        load_train_config([*base, "--model.name", str(folder)])
    # From scratch, the scaling belongs in the architecture.
    arch = ["--model.arch.model_type", "llama", "--model.arch.hidden_size", "64", "--model.arch.intermediate_size",
            "128", "--model.arch.num_hidden_layers", "2", "--model.arch.num_attention_heads", "4"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.rope_scaling: extends a pretrained model"):
        load_train_config([*base, *arch, *scaling])
