"""Tensor parallelism (`parallel.tp`) trains like one process: per-step losses, gradient norms and loss-token counts of
tp 2 (2 processes), tp 2 x dp 2, tp 2 x cp 2 and tp 2 inside HSDP's replica groups (4 processes) match one process
within 1e-5, with Muon and with AdamW, compiled with selective checkpointing, on Llama and on Qwen3 (QK-norm), with
CompleteP; an MoE with bias balancing at tp 2 and tp 2 x ep 2 has one process's losses, gradient norms and routing
biases, and so has one with hyper-connections and the sequence-wise balance loss at tp 2 (and, long mode, tp 2 x cp
2); emulated tensorwise FP8 at tp 2 keeps one process's first step and its FP8 parity after; parameter counts are one
process's; checkpoints resume across layouts ((dp 2, tp 2) -> dp 4 -> (tp 2, dp_replicate 2) -> one process); the
exported weights are the ones one process trains; validation, set files, `lmforge eval` and an SFT run give one
process's numbers. The long mode (`LMFORGE_PARALLEL_LONG=1`) adds the HSDP composition, compilation, AdamW, CompleteP
and SFT cases to what CI runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmforge.hf.folder import load_pretrained
from lmforge.monitor import read_metrics
from tests.conftest import arch_toml, tiny_qwen3
from tests.integration.runner import TINY_ARCH, curve, same_curves, train_run, write_config
from tests.integration.test_context_parallel_train import sft_matches_one_process, validation_matches_one_process
from tests.integration.test_moe_train import RUN as MOE_RUN
from tests.unit.test_fp8 import FP8_RTOL

pytestmark = pytest.mark.slow

LONG = os.environ.get("LMFORGE_PARALLEL_LONG") == "1" or os.environ.get("LMFORGE_LONG") == "1"
"""Long mode: also TP inside HSDP, compiled with checkpointing, AdamW, CompleteP, SFT, the HSDP leg of the resume
chain, an MoE at tp 2 x cp 2, and HSDP with AdamW (test_hybrid_shard_train). CI runs the short mode: tp 2, tp 2 x
dp 2, tp 2 x cp 2, Qwen3, MoE with EP, the MoE options and FP8, validation, resume."""
long_mode = pytest.mark.skipif(not LONG, reason="long mode: set LMFORGE_PARALLEL_LONG=1")

TP = ("--parallel.tp", "2")
KEYS = ("loss/mean", "optim/grad_norm", "loss/tokens")


def test_tp_trains_like_one_process_and_resumes_across_layouts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "base", max_steps=4)  # Muon for matrices (the default), AdamW for the rest
    keep = ("--ckpt.interval", "1", "--ckpt.keep-last", "4")
    one = train_run(cfg, tmp_path / "one")
    runs = {
        "tp2": train_run(cfg, tmp_path / "tp2", *TP, nproc=2),
        "tp2_dp2": train_run(cfg, tmp_path / "tp2_dp2", *TP, *keep, nproc=4),  # also the resume chain's start
        "tp2_cp2": train_run(cfg, tmp_path / "tp2_cp2", *TP, "--parallel.cp", "2", nproc=4),
    }
    if LONG:
        runs["tp2_hsdp"] = train_run(cfg, tmp_path / "tp2_hsdp", *TP, "--parallel.dp_replicate", "2", nproc=4)
        runs["tp2_compiled_ac"] = train_run(
            cfg, tmp_path / "tp2_compiled_ac", *TP, "--model.compile", "true", "--model.ac.mode", "selective", nproc=2
        )
        adamw = ("--optim.type", "adamw")
        same_curves(train_run(cfg, tmp_path / "one_adamw", *adamw),
                    {"tp2": train_run(cfg, tmp_path / "tp2_adamw", *adamw, *TP, nproc=2)}, KEYS, 4)  # fmt: skip
    same_curves(one, runs, KEYS, 4)
    # parameter counts (and so MFU) count each parameter once, not once per shard
    counts = [{k: v for r in read_metrics(run / "metrics.jsonl") for k, v in r.items() if k.startswith("params/")}
              for run in (one, runs["tp2_dp2"])]  # fmt: skip
    assert counts[0] and counts[0] == counts[1]

    # (dp 2, tp 2) for steps 1-2, dp 4 for step 3, then one process (and, long mode, tp 2 inside 2 replica groups)
    # for step 4, each resuming the previous layout's checkpoint
    start = runs["tp2_dp2"]
    train_run(cfg, tmp_path / "b", *keep, "--resume.step", "2", "--resume.path", str(start), nproc=4)
    train_run(cfg, tmp_path / "d", "--resume.step", "3", "--resume.path", str(tmp_path / "b"))
    want = curve(one, "loss/mean")
    chained = [*curve(start, "loss/mean")[:2], curve(tmp_path / "b", "loss/mean")[0]]
    assert chained == pytest.approx(want[:3], rel=1e-5)
    assert curve(tmp_path / "d", "loss/mean") == pytest.approx(want[3:], rel=1e-5)
    if LONG:
        train_run(cfg, tmp_path / "c", *TP, "--parallel.dp_replicate", "2", "--resume.step", "3", "--resume.path",
                  str(tmp_path / "b"), nproc=4)  # fmt: skip
        assert curve(tmp_path / "c", "loss/mean") == pytest.approx(want[3:], rel=1e-5)

    # the exported weights of a (dp 2, tp 2) run are one process's
    reference, _ = load_pretrained(one)
    got, _ = load_pretrained(runs["tp2_dp2"])
    mine = dict(got.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.allclose(mine[name], tensor, rtol=1e-4, atol=1e-6), name


def test_a_moe_under_tp_and_expert_parallelism_trains_like_one_process(tmp_path: Path) -> None:
    # each TP rank routes its own tokens of the sequence-parallel stream; under ep 2 the routed experts are split
    # over consecutive ranks (here the TP pair's), the router and shared experts stay whole on each
    cfg = tmp_path / "moe.toml"
    cfg.write_text(MOE_RUN.format(out=tmp_path / "unused"))
    one = train_run(cfg, tmp_path / "one")
    runs = {"tp2": train_run(cfg, tmp_path / "tp2", *TP, nproc=2),
            "tp2_ep2": train_run(cfg, tmp_path / "tp2_ep2", *TP, "--parallel.ep", "2", nproc=4)}  # fmt: skip
    same_curves(one, runs, (*KEYS, "moe/bias/abs_mean"), 8)


def test_moe_options_and_fp8_under_tp_train_like_one_process(tmp_path: Path) -> None:
    # hyper-connections hold each rank's tokens of the widened stream; the sequence-wise balance loss sums each
    # segment's choices over the TP pair; the shared experts are split like a dense MLP
    cfg = tmp_path / "moe.toml"
    cfg.write_text(MOE_RUN.format(out=tmp_path / "unused").replace("max_steps = 8", "max_steps = 4"))
    options = ("--model.arch.hyper_connections", "2", "--model.moe_balance.seq_aux_coeff", "0.01")
    one = train_run(cfg, tmp_path / "one", *options)
    runs = {"tp2": train_run(cfg, tmp_path / "tp2", *options, *TP, nproc=2)}
    if LONG:  # each rank's chunks and run of a row: CI checks cp 2 (test_moe_train) and tp 2 apart
        runs["tp2_cp2"] = train_run(cfg, tmp_path / "tp2_cp2", *options, *TP, "--parallel.cp", "2", nproc=4)
    same_curves(one, runs, (*KEYS, "moe/seq_aux_loss", "moe/bias/abs_mean"), 4)
    # Emulated tensorwise float8: every scale is the whole tensor's, as in one process, so the first step agrees to
    # fp32 precision (a weight scaled per TP part moved it by 2e-5). Later steps start from weights that differ in
    # the order of fp32 sums, which can flip a float8 rounding: they agree to the FP8 parity tolerance.
    fp8 = ("--model.fp8", "tensorwise", "--model.fp8_emulate", "true")
    want = curve(train_run(cfg, tmp_path / "one_fp8", *fp8), "loss/mean")
    run = train_run(cfg, tmp_path / "tp2_fp8", *fp8, *TP, nproc=2)
    got = curve(run, "loss/mean")
    assert got[0] == pytest.approx(want[0], rel=2e-6)
    assert got == pytest.approx(want, rel=FP8_RTOL)
    log = (run / "logs" / "rank_0.log").read_text()
    assert "fp8 tensorwise on" in log and "float8 all-gather" not in log  # FSDP gathers TP-split weights unscaled


def test_tp_with_qk_norm_trains_like_one_process(tmp_path: Path) -> None:
    # Qwen3: the per-head norm scales see each rank's heads only; their gradients are summed over the TP group
    cfg = write_config(tmp_path, "qwen", max_steps=3)
    cfg.write_text(cfg.read_text().replace(TINY_ARCH, arch_toml(tiny_qwen3(max_position_embeddings=256))))
    one = train_run(cfg, tmp_path / "one")
    same_curves(one, {"tp2": train_run(cfg, tmp_path / "tp2", *TP, nproc=2)}, KEYS, 3)


@long_mode
def test_tp_with_completep_trains_like_one_process(tmp_path: Path) -> None:
    # CompleteP's per-role init and learning rates find every split parameter under its own name
    cfg = write_config(tmp_path, "completep", max_steps=3)
    flags = ("--model.init.scheme", "completep", "--model.arch.tie_word_embeddings", "false",
             "--model.init.base_hidden_size", "32", "--model.init.base_num_layers", "1")  # fmt: skip
    one = train_run(cfg, tmp_path / "one", *flags)
    same_curves(one, {"tp2": train_run(cfg, tmp_path / "tp2", *flags, *TP, nproc=2)}, KEYS, 3)


def test_validation_under_tp_equals_one_process(tmp_path: Path) -> None:
    validation_matches_one_process(tmp_path, TP)


@long_mode
def test_an_sft_run_under_tp_equals_one_process(tmp_path: Path) -> None:
    sft_matches_one_process(tmp_path, TP)
