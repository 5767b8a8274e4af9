"""Pipeline parallelism (`parallel.pp`) trains like one process: per-step losses, gradient norms (whole and per
optimizer group) and loss-token counts of a 4-layer Llama cut into stages match one process within 1e-5 with every
schedule, alone (2 processes) and with FSDP, HSDP, context or tensor parallelism inside the stages (4 processes), and
so do an MoE's losses and routing biases, also with expert parallelism inside a stage, and hyper-connections' widened
stream; checkpoints resume across pipeline layouts (pp 2 -> pp 4 -> pp 2 in a V, and pp 2 -> one process), the
run's export holds one process's weights, and validation (token sets and every set-file convention) and `lmforge
eval` of its snapshots give one process's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.hf.folder import load_pretrained
from lmforge.monitor import read_metrics
from tests.conftest import LONG, require, tiny_llama
from tests.integration.runner import curve, same_curves, train_run, write_config
from tests.integration.test_context_parallel_train import validation_matches_one_process
from tests.integration.test_moe_train import RUN

pytestmark = pytest.mark.slow

ARCH = tiny_llama(num_hidden_layers=4, max_position_embeddings=256)
"""Four layers: two stages per rank on two ranks."""

KEYS = ("loss/mean", "optim/grad_norm", "loss/tokens", "optim/grad_norm/embed", "optim/grad_norm/head")


def pp(schedule: str, *more: str) -> tuple[str, ...]:
    """The flags of a pp 2 run with `schedule`."""
    return ("--parallel.pp", "2", "--parallel.pp_schedule", schedule, *more)


def test_every_schedule_trains_like_one_process(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "base", max_steps=4, arch=ARCH)
    one = train_run(cfg, tmp_path / "one")
    # CI: one stage per rank, and the interleaved zero-bubble schedule (split backward, two stages per rank); long
    # mode adds the interleaved 1F1B and the V schedule, and a split given by hand.
    schedules = ["1f1b", "interleaved_zb"] + (["interleaved_1f1b", "zbv"] if LONG else [])
    runs = {s: train_run(cfg, tmp_path / s, *pp(s), nproc=2) for s in schedules}
    if LONG:
        runs["uneven"] = train_run(cfg, tmp_path / "uneven", *pp("1f1b", "--parallel.pp_layers", "[1, 3]"), nproc=2)
    same_curves(one, runs, KEYS, 4)
    record = read_metrics(runs["1f1b"] / "metrics.jsonl")[-1]
    assert record["perf/peak_memory/pp0"] > 0 and record["perf/peak_memory/pp1"] > 0


def test_hyper_connections_widened_stream_crosses_stages_like_one_process(tmp_path: Path) -> None:
    # the stream [n, T, hidden] is sent between stages, expanded on the first and summed on the last; the
    # interleaved zero-bubble schedule runs each stage's backward in two passes. Long mode adds TP inside the
    # stages, where each rank sends its tokens of every copy.
    cfg = tmp_path / "moe.toml"  # hyper-connections are a GLM option
    cfg.write_text(RUN.format(out=tmp_path / "unused").replace("max_steps = 8", "max_steps = 3"))
    hc = ("--model.arch.hyper_connections", "2", "--model.arch.num_hidden_layers", "4")
    one = train_run(cfg, tmp_path / "one", *hc)
    runs = {"pp2": train_run(cfg, tmp_path / "pp2", *hc, *pp("interleaved_zb"), nproc=2)}
    if LONG:
        runs["pp2_tp2"] = train_run(cfg, tmp_path / "pp2_tp2", *hc, *pp("1f1b", "--parallel.tp", "2"), nproc=4)
    same_curves(one, runs, KEYS, 3)


def test_pipeline_with_fsdp_hsdp_and_cp_inside_stages_and_resume_across_layouts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "base", max_steps=4, arch=ARCH)
    one = train_run(cfg, tmp_path / "one")
    runs = {
        # 2 stage groups of 2 ranks, FSDP sharding each stage over its group's 2 ranks
        "pp2_dp2": train_run(cfg, tmp_path / "pp2_dp2", *pp("interleaved_1f1b"), nproc=4),
        # ... or one context-parallel pair splitting every row (each stage sends its half of the row's states)
        "pp2_cp2": train_run(cfg, tmp_path / "pp2_cp2", *pp("interleaved_zb", "--parallel.cp", "2"), nproc=4),
    }
    if LONG:  # ... or 2 replicas of one rank each (HSDP: the same stage groups, another gradient reduction)
        runs["pp2_hsdp"] = train_run(cfg, tmp_path / "pp2_hsdp", *pp("1f1b", "--parallel.dp_replicate", "2"), nproc=4)
    same_curves(one, runs, KEYS, 4)

    # pp 2 for steps 1-2, pp 4 (one layer per stage) for step 3, pp 2 in a V (zbv) for step 4, each resuming the
    # previous layout; resuming on one process is in the tensor-parallel case below
    keep = ("--ckpt.interval", "1", "--ckpt.keep-last", "4")
    train_run(cfg, tmp_path / "a", *keep, *pp("1f1b"), nproc=2)
    pp4 = ("--parallel.pp", "4", "--resume.step", "2", "--resume.path", str(tmp_path / "a"))
    train_run(cfg, tmp_path / "b", *keep, *pp4, nproc=4)  # steps 3-4: max_steps shapes the schedule
    train_run(cfg, tmp_path / "c", *pp("zbv"), "--resume.step", "3", "--resume.path", str(tmp_path / "b"), nproc=2)
    chained = [*curve(tmp_path / "a", "loss/mean")[:2], curve(tmp_path / "b", "loss/mean")[0],
               *curve(tmp_path / "c", "loss/mean")]  # fmt: skip
    assert chained == pytest.approx(curve(one, "loss/mean"), rel=1e-5)

    # the pipelined run's final weights are one process's
    want, _ = load_pretrained(one)
    got, _ = load_pretrained(runs["pp2_dp2"])
    mine = dict(got.state_dict())
    assert mine.keys() == want.state_dict().keys()
    for name, tensor in want.state_dict().items():
        assert torch.allclose(mine[name], tensor, rtol=1e-4, atol=1e-6), name


def test_validation_under_pipeline_parallelism_equals_one_process(tmp_path: Path) -> None:
    # every row goes forward through both stages; the loss rank scores it, the other counts nothing. The eval
    # worker scores the run's snapshots with the whole model on each of its ranks.
    validation_matches_one_process(tmp_path, pp("zbv"), arch=ARCH)


def test_a_moe_under_pipeline_and_expert_parallelism_trains_like_one_process(tmp_path: Path) -> None:
    # GLM's first layer is dense: at pp 2 one rank holds no MoE block, yet both reduce every block's routing counts
    # and keep every block's bias on the host; the biases move as one process moves them.
    cfg = tmp_path / "moe.toml"
    cfg.write_text(RUN.format(out=tmp_path / "unused"))
    keys = ("loss/mean", "optim/grad_norm", "moe/bias/abs_mean", "moe/rank_load/mean")
    one = train_run(cfg, tmp_path / "one")
    same_curves(one, {"pp2": train_run(cfg, tmp_path / "pp2", *pp("1f1b"), nproc=2)}, keys, 8)
    # pp 2 x ep 2: the MoE stage's 2 ranks split its experts (their all-to-all inside the stage group); its
    # checkpoint resumes on one process with the uninterrupted losses
    piped = train_run(cfg, tmp_path / "pp2_ep2", *pp("1f1b", "--parallel.ep", "2", "--ckpt.interval", "4"), nproc=4)
    same_curves(one, {"pp2_ep2": piped}, keys[:3], 8)
    resumed = train_run(cfg, tmp_path / "resumed", "--resume.step", "4", "--resume.path", str(piped))
    assert curve(resumed, "loss/mean") == pytest.approx(curve(one, "loss/mean")[4:], rel=1e-5)
    # 4 layers in a V, both ranks holding MoE blocks, with the quantile rule and the sequence-wise loss (long mode)
    if LONG:
        flags = ("--model.arch.num_hidden_layers", "4", "--model.moe_balance.rule", "quantile",
                 "--model.moe_balance.seq_aux_coeff", "0.01")  # fmt: skip
        one = train_run(cfg, tmp_path / "one_q", *flags)
        piped = train_run(cfg, tmp_path / "zbv_q", *flags, *pp("zbv"), nproc=2)
        same_curves(one, {"zbv": piped}, (*keys, "moe/seq_aux_loss"), 8)


def test_pipeline_with_tensor_parallelism_inside_stages_trains_and_resumes_like_one_process(tmp_path: Path) -> None:
    # pp 2 x tp 2: each stage's matmuls split over a TP pair, each rank sending its half of the sequence-parallel
    # stream to its peer in the next stage. The split backward of the zero-bubble schedule runs the TP collectives
    # of the input and weight gradients in two passes. Its checkpoint resumes on one process.
    cfg = write_config(tmp_path, "base", max_steps=4, arch=ARCH)
    one = train_run(cfg, tmp_path / "one")
    tp = ("--parallel.tp", "2")
    piped = train_run(cfg, tmp_path / "pp2_tp2", *pp("interleaved_zb", *tp, "--ckpt.interval", "2"), nproc=4)
    runs = {"pp2_tp2": piped}
    if LONG:
        runs |= {s: train_run(cfg, tmp_path / s, *pp(s, *tp), nproc=4) for s in ("1f1b", "interleaved_1f1b", "zbv")}
    same_curves(one, runs, KEYS, 4)
    resumed = train_run(cfg, tmp_path / "resumed", "--resume.step", "2", "--resume.path", str(piped))
    assert curve(resumed, "loss/mean") == pytest.approx(curve(one, "loss/mean")[2:], rel=1e-5)


@pytest.mark.long
def test_tensor_parallel_stages_validate_and_train_a_moe_like_one_process(tmp_path: Path) -> None:
    # validation and lmforge eval through pp 2 x tp 2; an MoE's stages under TP (each rank routing its own tokens)
    validation_matches_one_process(tmp_path / "val", pp("1f1b", "--parallel.tp", "2"), arch=ARCH, nproc=4)
    cfg = tmp_path / "moe.toml"
    cfg.write_text(RUN.format(out=tmp_path / "unused"))
    keys = ("loss/mean", "optim/grad_norm", "moe/bias/abs_mean", "moe/rank_load/mean")
    one = train_run(cfg, tmp_path / "one")
    piped = train_run(cfg, tmp_path / "pp2_tp2", *pp("1f1b", "--parallel.tp", "2"), nproc=4)
    same_curves(one, {"pp2_tp2": piped}, keys[:3], 8)
    # each rank of a TP pair computes the expert copies of its own half of the tokens
    assert curve(piped, keys[3]) == [load / 2 for load in curve(one, keys[3])]


@pytest.mark.long
def test_compiled_checkpointed_and_fp8_stages_train_like_one_process(tmp_path: Path) -> None:
    # compiled blocks with selective checkpointing (interleaved 1F1B; the zero-bubble schedules refuse selective
    # checkpointing), and emulated float8 with full checkpointing under the split backward of interleaved_zb
    require("torchao.float8")
    cfg = write_config(tmp_path, "base", max_steps=4, arch=ARCH)
    compiled = ("--model.compile", "true")
    one = train_run(cfg, tmp_path / "one", *compiled)
    selective = pp("interleaved_1f1b", "--model.ac.mode", "selective")
    piped = train_run(cfg, tmp_path / "sel", *compiled, *selective, nproc=2)
    same_curves(one, {"compiled_selective": piped}, KEYS, 4)
    fp8 = ("--model.fp8", "tensorwise", "--model.fp8_emulate", "true")
    one = train_run(cfg, tmp_path / "one_fp8", *fp8)
    piped = train_run(cfg, tmp_path / "fp8", *fp8, *pp("interleaved_zb", "--model.ac.mode", "full"), nproc=2)
    same_curves(one, {"fp8_full": piped}, KEYS, 4)
