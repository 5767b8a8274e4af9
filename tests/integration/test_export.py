"""From a run to a plain HF folder and back: `lmforge export`, `model.name` loading (sharded), `lmforge sample`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.hf.folder import load_pretrained
from tests.conftest import require
from tests.integration.runner import run_cli, write_config
from tests.shards import word_tokenizer

transformers = require("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run with a tokenizer, so its checkpoint carries tokenizer files."""
    tmp = tmp_path_factory.mktemp("export")
    tokenizer = word_tokenizer(tmp / "tokenizer")
    cfg = write_config(tmp, "run", max_steps=6)
    result = run_cli(["train", "@", str(cfg), "--tokenizer.name", str(tokenizer)])
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


def _export(run: Path, out: Path, dtype: str = "float32") -> None:
    result = run_cli(["export", str(run), "--output", str(out), "--dtype", dtype])
    assert result.returncode == 0, result.stderr[-3000:]


def test_export_loads_in_transformers_with_the_same_logits(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(run, out)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours, _ = load_pretrained(run)
    ids = torch.randint(0, 200, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids, torch.arange(48)[None], torch.tensor([48], dtype=torch.int32))
        got = hf(input_ids=ids).logits
    assert (expected - got).abs().max().item() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer("w1 w2")["input_ids"] == [1, 2]


def test_bfloat16_export(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf16"
    _export(run, out, "bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(hf.parameters()).dtype == torch.bfloat16


def test_export_refuses_to_overwrite_and_names_missing_runs(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(run, out)
    again = run_cli(["export", str(run), "--output", str(out)])
    assert again.returncode == 2 and "not empty" in again.stderr
    missing = run_cli(["export", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")])
    assert missing.returncode == 2 and "has no checkpoint" in missing.stderr and "Traceback" not in missing.stderr


def test_hf_folder_trains_and_exports_back_unchanged_on_two_ranks(run: Path, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    _export(run, source)
    cfg = write_config(tmp_path, "sft", max_steps=1)
    # lr 1e-30 changes no fp32 weight: what the 2-rank sharded model loaded must come out exactly as it went in.
    result = run_cli(["train", "@", str(cfg), "--model.name", str(source), "--optim.lr", "1e-30"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "sft" / "model" / "tokenizer.json").is_file(), "the tokenizer came from model.name"
    back = tmp_path / "back"
    _export(tmp_path / "sft", back)
    original, exported = load_file(source / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


def test_model_name_with_a_different_arch_is_refused(run: Path, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    _export(run, source)
    cfg = write_config(tmp_path, "bad", max_steps=1)
    result = run_cli(["train", "@", str(cfg), "--model.name", str(source), "--model.arch.hidden-size", "96"])
    assert result.returncode == 2 and "hidden_size: 96 here vs 64" in result.stderr


def test_sample_streams_the_same_text_from_the_run_and_its_export(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(run, out)
    args = ["--prompt", "w1 w2 w3", "--max-new-tokens", "12", "--temperature", "0"]
    from_run = run_cli(["sample", str(run), *args])
    from_export = run_cli(["sample", str(out), *args])
    assert from_run.returncode == 0, from_run.stderr[-3000:]
    assert from_run.stdout.startswith("w1 w2 w3") and len(from_run.stdout.split()) > 3
    assert from_run.stdout == from_export.stdout
    seeded = [run_cli(["sample", str(run), "--prompt", "w1", "--max-new-tokens", "12", "--seed", "5"]).stdout
              for _ in range(2)]  # fmt: skip
    assert seeded[0] == seeded[1] and seeded[0].startswith("w1")


def test_random_init_takes_only_the_architecture(run: Path, tmp_path: Path) -> None:
    from lmforge.model import build_model
    from lmforge.model.init import init_weights

    source = tmp_path / "hf"
    _export(run, source)
    cfg = write_config(tmp_path, "smoke", max_steps=1)
    flags = ["--model.name", str(source), "--model.debug.random-init", "--optim.lr", "1e-30", "--model.init.seed", "4"]
    result = run_cli(["train", "@", str(cfg), *flags])
    assert result.returncode == 0, result.stderr[-3000:]
    model, _ = load_pretrained(tmp_path / "smoke")
    fresh = build_model(model.arch, model.vocab_size, "sdpa", torch.device("cpu"))
    init_weights(fresh, 0.02, seed=4)
    loaded = load_file(source / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    assert not torch.equal(model.state_dict()["lm_head.weight"], loaded["lm_head.weight"])


def test_completep_model_exports_as_a_plain_llama(run: Path, tmp_path: Path) -> None:
    """The CompleteP multipliers live in the weights: transformers computes the same logits without them."""
    cfg = write_config(tmp_path, "cp", max_steps=3)
    flags = ["--model.init.scheme", "completep", "--model.init.base-hidden-size", "32", "--model.init.base-num-layers",
             "1", "--tokenizer.name", str(run.parent / "tokenizer")]  # fmt: skip
    result = run_cli(["train", "@", str(cfg), *flags])
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "hf"
    _export(tmp_path / "cp", out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, _ = load_pretrained(tmp_path / "cp")
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids, torch.arange(40)[None], torch.tensor([40], dtype=torch.int32))
        assert (expected - hf(input_ids=ids).logits).abs().max().item() <= 1e-4
