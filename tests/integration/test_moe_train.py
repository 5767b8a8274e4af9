"""An MoE model through the CLI: balancing uses global counts (1 and 2 processes end with the same bias), resume
reproduces the bias and the losses, and the routing metrics are logged; the research options train alike on 1 and
2 processes and round-trip through export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.hf.folder import load_pretrained
from lmforge.model.generate import generate
from lmforge.monitor import read_metrics
from tests.integration.runner import losses, run_cli, same_curves

pytestmark = pytest.mark.slow

RUN = """
max_steps = 8
output_dir = "{out}"

[model.arch]
model_type = "glm4_moe"
hidden_size = 64
intermediate_size = 128
moe_intermediate_size = 32
n_routed_experts = 8
num_experts_per_tok = 2
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 256

[model.moe_balance]
coeff = 0.01

[data]
type = "fake"
seq_len = 64
batch_tokens = 1024
micro_batch_tokens = 256
vocab_size = 200
pattern = "counting"

[optim]
lr = 3e-3
"""


def bias(run: Path) -> torch.Tensor:
    model, _ = load_pretrained(run)
    return model.moe_layers()[1].gate.e_score_correction_bias.clone()


def run(tmp_path: Path, name: str, *flags: str, nproc: int = 1) -> Path:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(RUN.format(out=tmp_path / name))
    result = run_cli(["train", "@", str(cfg), *flags], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / name


def test_balancing_is_global_and_resumes_exactly(tmp_path: Path) -> None:
    straight = run(tmp_path, "straight")
    records = [r for r in read_metrics(straight / "metrics.jsonl") if r["step"] > 0]
    assert all(r["max_vio/mean"] >= 0 and 0 < r["routing_confidence/mean"] <= 1 for r in records)
    assert records[-1]["moe/bias/abs_mean"] > 0 and "expert_load/layer_1/cv" in records[-1]
    final = bias(straight)
    moves = final / 0.01  # every update moves each entry by -coeff, 0 or +coeff
    assert final.abs().sum() > 0 and torch.allclose(moves, moves.round(), atol=1e-4) and moves.abs().max() <= 8
    # Two processes see half the tokens each; with global counts their bias is the single process's.
    two = run(tmp_path, "two", nproc=2)
    assert torch.equal(bias(two), final)
    assert losses(two) == pytest.approx(losses(straight), rel=1e-5, abs=1e-5)
    # A resume at step 4 continues with the saved bias: the same losses and the same final bias.
    resumed = run(tmp_path, "resumed", "--ckpt.interval", "4")
    run(tmp_path, "resumed", "--resume.step", "4")
    assert torch.equal(bias(resumed), final)
    assert losses(resumed) == losses(straight)


def test_sequence_balance_loss_trains_the_same_on_one_and_two_processes(tmp_path: Path) -> None:
    flags = ("--model.moe-balance.seq-aux-coeff", "0.01", "--max-steps", "4")
    one = run(tmp_path, "one", *flags)
    two = run(tmp_path, "two", *flags, nproc=2)
    plain = run(tmp_path, "plain", "--max-steps", "4")
    records = [r for r in read_metrics(one / "metrics.jsonl") if r["step"] > 0]
    # sum_i f_i P_i is 1 for a uniform router (f_i = 1, P_i = 1 / E); with coeff 0.01 and one MoE layer, about 0.01
    assert all(0.005 < r["moe/seq_aux_loss"] < 0.05 for r in records)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5, abs=1e-5)
    # under CP each rank routes its chunks of a row: the choices are summed over the pair, the segments counted once
    split = run(tmp_path, "cp2", *flags, "--parallel.cp", "2", nproc=2)
    same_curves(one, {"cp2": split}, ("loss/mean", "optim/grad_norm", "moe/seq_aux_loss"), 4)
    assert losses(one)[0] == losses(plain)[0], "the first forward is the same; the loss term acts through gradients"
    assert losses(one)[1:] != losses(plain)[1:]


def test_balancing_under_context_parallelism_counts_every_token_once(tmp_path: Path) -> None:
    straight = run(tmp_path, "straight", "--max-steps", "4")
    split = run(tmp_path, "cp2", "--max-steps", "4", "--parallel.cp", "2", nproc=2)
    assert torch.equal(bias(split), bias(straight))
    assert losses(split) == pytest.approx(losses(straight), rel=1e-5, abs=1e-5)
    want = [r for r in read_metrics(straight / "metrics.jsonl") if r["step"] > 0]
    got = [r for r in read_metrics(split / "metrics.jsonl") if r["step"] > 0]
    for a, b in zip(want, got, strict=True):
        assert b["expert_load/layer_1/cv"] == pytest.approx(a["expert_load/layer_1/cv"], rel=1e-5, abs=1e-6)


def test_research_options_train_alike_on_one_and_two_processes_and_round_trip(tmp_path: Path) -> None:
    options = ("--model.arch.attn-output-gate", "elementwise", "--model.arch.xsa", "--model.arch.null-experts", "2",
               "--model.arch.moe-latent-size", "16", "--model.arch.expert-glu", "situ_glu",
               "--model.arch.hyper-connections", "2")  # fmt: skip
    one = run(tmp_path, "opt1", *options)
    # Null experts and latent copies (16 wide) under expert parallelism.
    two = run(tmp_path, "opt2", *options, "--parallel.ep", "2", nproc=2)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5, abs=1e-5)
    last = [r for r in read_metrics(one / "metrics.jsonl") if "moe/null_share" in r][-1]
    assert 0 < last["moe/null_share"] < 1 and 0 < last["moe/real_k"] < 2
    assert torch.equal(bias(two), bias(one)) and bias(one).numel() == 10
    # `lmforge export` writes lmforge's own model type; the run and its export generate the same tokens.
    folder = tmp_path / "hf"
    assert run_cli(["export", str(one), "--output", str(folder), "--dtype", "float32"]).returncode == 0
    written = (folder / "config.json").read_text()
    assert '"model_type": "lmforge_moe"' in written and '"moe_latent_size": 16' in written
    assert '"hyper_connections": 2' in written
    texts = [list(generate(load_pretrained(path)[0], [5, 6, 7], 12, temperature=0)) for path in (one, folder)]
    assert texts[0] == texts[1] and len(texts[0]) == 12


def test_quantile_balancing_is_global_and_resumes_exactly(tmp_path: Path) -> None:
    flags = ("--model.moe-balance.rule", "quantile", "--model.arch.router-bias-on-logits")
    straight = run(tmp_path, "q1", *flags)
    records = [r for r in read_metrics(straight / "metrics.jsonl") if r["step"] > 0]
    assert all(0 <= r["moe/quantile/edge_share"] < 1 for r in records)
    final = bias(straight)
    assert final.abs().sum() > 0 and abs(float(final.mean())) < 1e-5, "the quantile bias is centred"
    # Two processes (each routing half the tokens, with the expert stacks split by expert parallelism) reduce the
    # same histograms: the same biases and losses as one process.
    two = run(tmp_path, "q2", *flags, "--parallel.ep", "2", nproc=2)
    assert torch.allclose(bias(two), final, atol=1e-6)
    assert losses(two) == pytest.approx(losses(straight), rel=1e-5, abs=1e-5)
    # Context parallelism: every token's values are recorded once, on the rank that holds it.
    split = run(tmp_path, "qcp", *flags, "--parallel.cp", "2", nproc=2)
    assert torch.allclose(bias(split), final, atol=1e-6)
    # A resume at step 4 bins over the saved ranges: the same losses and the same final bias, exactly.
    resumed = run(tmp_path, "qr", *flags, "--ckpt.interval", "4")
    run(tmp_path, "qr", *flags, "--resume.step", "4")
    assert losses(resumed) == losses(straight)
    assert torch.equal(bias(resumed), final)
