"""Hybrid sharding (`parallel.dp_replicate`, HSDP) trains like one process: per-step losses and gradient norms of 2
replica groups x 2 shards (4 processes), with Muon and (long mode, `LMFORGE_PARALLEL_LONG=1`) AdamW, with context
parallelism inside the groups, and a MoE with expert parallelism, match one process within 1e-5; checkpoints resume
across layouts (dp 4 -> HSDP 2 x 2 -> one process), and the exported weights are the ones one process trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.hf.folder import load_pretrained
from tests.integration.runner import curve, same_curves, train_run, write_config
from tests.integration.test_context_parallel_train import validation_matches_one_process
from tests.integration.test_moe_train import RUN
from tests.integration.test_tensor_parallel_train import LONG

pytestmark = pytest.mark.slow

HSDP = ("--parallel.dp_replicate", "2")


def test_hsdp_trains_like_one_process_and_resumes_across_layouts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "base", max_steps=4)  # Muon for matrices (the default), AdamW for the rest
    one = train_run(cfg, tmp_path / "one")
    runs = {
        "hsdp": train_run(cfg, tmp_path / "hsdp", *HSDP, nproc=4),
        # the two ranks of each replica group split every row between them
        "hsdp_cp2": train_run(cfg, tmp_path / "hsdp_cp2", *HSDP, "--parallel.cp", "2", nproc=4),
    }
    same_curves(one, runs, ("loss/mean", "optim/grad_norm", "loss/tokens"), 4)
    if LONG:  # AdamW's replicated step; CI's short mode checks HSDP with Muon
        flags = ("--optim.type", "adamw")
        one_adamw = train_run(cfg, tmp_path / "one_adamw", *flags)
        same_curves(one_adamw, {"hsdp": train_run(cfg, tmp_path / "hsdp_adamw", *flags, *HSDP, nproc=4)},
                     ("loss/mean", "optim/grad_norm"), 4)  # fmt: skip

    # dp 4 for steps 1-2, HSDP 2 x 2 for step 3, one process for step 4, each resuming the previous layout
    keep = ("--ckpt.interval", "1", "--ckpt.keep-last", "4")
    train_run(cfg, tmp_path / "a", *keep, nproc=4)
    train_run(cfg, tmp_path / "b", *keep, *HSDP, "--resume.step", "2", "--resume.path", str(tmp_path / "a"), nproc=4)
    train_run(cfg, tmp_path / "c", "--resume.step", "3", "--resume.path", str(tmp_path / "b"))
    chained = [*curve(tmp_path / "a", "loss/mean")[:2], curve(tmp_path / "b", "loss/mean")[0],
               *curve(tmp_path / "c", "loss/mean")]  # fmt: skip
    assert chained == pytest.approx(curve(one, "loss/mean"), rel=1e-5)

    # the final weights of the HSDP run are one process's
    want, _ = load_pretrained(one)
    got, _ = load_pretrained(runs["hsdp"])
    mine = dict(got.state_dict())
    for name, tensor in want.state_dict().items():
        assert torch.allclose(mine[name], tensor, rtol=1e-4, atol=1e-6), name


def test_a_moe_under_hsdp_and_expert_parallelism_trains_like_one_process(tmp_path: Path) -> None:
    # Each replica group of 2 ranks is one expert-parallel group: the expert stacks, like the dense weights, are
    # sharded within a group and replicated across the two. A checkpoint of that layout resumes on one process.
    cfg = tmp_path / "moe.toml"
    cfg.write_text(RUN.format(out=tmp_path / "unused"))
    one = train_run(cfg, tmp_path / "one")
    hybrid = train_run(cfg, tmp_path / "hsdp_ep2", *HSDP, "--parallel.ep", "2", "--ckpt.interval", "4", nproc=4)
    same_curves(one, {"hsdp_ep2": hybrid}, ("loss/mean", "optim/grad_norm", "moe/bias/abs_mean"), 8)
    resumed = train_run(cfg, tmp_path / "resumed", "--resume.step", "4", "--resume.path", str(hybrid))
    assert curve(resumed, "loss/mean") == pytest.approx(curve(one, "loss/mean")[4:], rel=1e-5)


def test_validation_under_hsdp_equals_one_process(tmp_path: Path) -> None:
    # 2 replica groups of one rank each: every rank scores its own rows, as data-parallel ranks do
    validation_matches_one_process(tmp_path, HSDP)


def test_dp_replicate_must_divide_the_world_size(tmp_path: Path) -> None:
    from lmforge.config import ConfigError, load_train_config

    with pytest.raises(ConfigError, match=r"parallel.dp_replicate .*3 does not divide the world size 4"):
        load_train_config(["@", str(write_config(tmp_path, "bad")), "--parallel.dp_replicate", "3"], 4)
