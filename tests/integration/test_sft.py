"""SFT through the CLI: pretrain -> export -> SFT from that folder -> export -> transformers; resume and ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.data.tokenizer import load_tokenizer
from lmforge.hf.folder import load_pretrained
from lmforge.monitor import read_metrics
from tests.chat import chat_tokenizer, conversation, write_jsonl
from tests.conftest import require
from tests.integration.runner import TINY_ARCH, losses, run_cli
from tests.shards import random_docs, write_shard

pytestmark = pytest.mark.slow

SFT = """
max_steps = {steps}
output_dir = "{out}"

[model]
name = "{model}"

[data]
type = "sft"
paths = ["{train}"]
seq_len = 128
batch_tokens = 512
micro_batch_tokens = 256
max_epochs = 4

[val]
data = "{val}"
interval = 3

[optim]
lr = 3e-3
"""


def chat_rows(n: int, offset: int = 0) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(offset, offset + n):
        if i % 4 == 3:
            rows.append({"prompt": f"why do you ask {i}", "completion": " the king speaks"})
        else:
            rows.append({"messages": conversation(i, turns=1 + i % 2, system=i % 3 == 0, tool=i % 5 == 1)})
    return rows


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model pretrained for 4 steps on token shards of the chat tokenizer, exported as an HF folder."""
    tmp = tmp_path_factory.mktemp("sft")
    tok_dir = chat_tokenizer(tmp / "tokenizer")
    tok = load_tokenizer(tok_dir)
    write_shard(tmp / "shards", "a", random_docs(60, seed=0, eos=tok.eos_id, vocab=tok.size))
    cfg = tmp / "pretrain.toml"
    cfg.write_text(
        f'max_steps = 4\noutput_dir = "{tmp / "pre"}"\n[tokenizer]\nname = "{tok_dir}"\n{TINY_ARCH}\n'
        f'[data]\ntype = "tokens"\npaths = ["{tmp / "shards"}"]\nseq_len = 64\nbatch_tokens = 256\n'
        "micro_batch_tokens = 128\n[optim]\nlr = 3e-3\n"
    )
    result = run_cli(["train", "@", str(cfg)])
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(["export", str(tmp / "pre"), "--output", str(tmp / "hf"), "--dtype", "float32"])
    assert result.returncode == 0, result.stderr[-3000:]
    write_jsonl(tmp / "chat" / "train.jsonl", chat_rows(48))
    write_jsonl(tmp / "chat" / "val.jsonl", chat_rows(12, offset=100))
    return tmp


def sft_config(tmp: Path, name: str, steps: int) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(SFT.format(steps=steps, out=tmp / name, model=tmp / "hf", train=tmp / "chat" / "train.jsonl",
                               val=tmp / "chat" / "val.jsonl"))  # fmt: skip
    return path


def test_pretrain_export_sft_export_loads_in_transformers(pretrained: Path) -> None:
    transformers = require("transformers")
    result = run_cli(["train", "@", str(sft_config(pretrained, "sft", 6))])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(pretrained / "sft" / "metrics.jsonl")
    assert records[0]["data/samples"] == 48 and records[0]["data/overlong"] == 0
    val = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in val] == [3, 6] and all(0 < r["val/loss"] < 7 for r in val)
    assert val[-1]["val/perplexity"] == pytest.approx(torch.tensor(val[-1]["val/loss"]).exp().item(), rel=1e-6)
    steps = [r for r in records if r["step"] > 0]
    assert all(0 < r["loss/tokens"] < 512 for r in steps), "only assistant tokens count"
    out = pretrained / "sft-hf"
    result = run_cli(["export", str(pretrained / "sft"), "--output", str(out), "--dtype", "float32"])
    assert result.returncode == 0, result.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, _ = load_pretrained(pretrained / "sft")
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids, torch.arange(40)[None], torch.tensor([40], dtype=torch.int32))
        assert (expected - hf(input_ids=ids).logits).abs().max().item() <= 1e-4
    start = transformers.AutoModelForCausalLM.from_pretrained(pretrained / "hf", dtype=torch.float32)
    assert not torch.equal(start.lm_head.weight, hf.lm_head.weight), "SFT changed the pretrained weights"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.chat_template, "the exported folder keeps the chat template"
    sample = run_cli(["sample", str(out), "--chat", "--prompt", "why do you ask", "--max-new-tokens", "8"])
    assert sample.returncode == 0, sample.stderr[-3000:]


def test_sft_resume_and_two_ranks_reproduce_the_run(pretrained: Path) -> None:
    straight = run_cli(["train", "@", str(sft_config(pretrained, "straight", 8))])
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = losses(pretrained / "straight")
    cfg = sft_config(pretrained, "resumed", 8)
    first = run_cli(["train", "@", str(cfg), "--max-steps", "8", "--ckpt.interval", "4", "--ckpt.final", "false"],
                    timeout=240)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_cli(["train", "@", str(cfg), "--resume.step", "4"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(pretrained / "resumed") == expected, "a resume at step 4 reproduces steps 5-8 exactly"
    state = json.loads((pretrained / "resumed" / "checkpoints" / "step_4" / "trainer.json").read_text())
    assert state["data"]["samples"] == 48 and state["data"]["epoch"] >= 0
    two = run_cli(["train", "@", str(sft_config(pretrained, "two", 8))], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert losses(pretrained / "two") == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_sft_errors_are_one_line(pretrained: Path, tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": conversation(0)}, {"question": "where is the answer"}])
    result = run_cli(["train", "@", str(sft_config(pretrained, "bad", 2)), "--data.paths", f'["{bad}"]'])
    assert result.returncode == 2 and "bad.jsonl line 2: a row needs `messages`" in result.stderr
    assert "Traceback" not in result.stderr
    many = run_cli(["train", "@", str(sft_config(pretrained, "many", 500))])
    assert many.returncode == 2 and "set max_steps to at most" in many.stderr and "Traceback" not in many.stderr
