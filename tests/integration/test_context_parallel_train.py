"""Training under context parallelism equals training without it: per-step losses and gradient norms with
cp = 2 (2 processes) and cp = 2 x dp = 2 (4 processes) match one process within 1e-5 (fp32, document masking on,
documents crossing chunk boundaries), a checkpoint resumes across layouts, validation gives the numbers it gives
on one process, and so does an SFT run."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lmforge.config.arch import AnyArch
from lmforge.monitor import read_metrics
from tests.chat import chat_tokenizer, conversation, write_jsonl
from tests.conftest import arch_toml, tiny_qwen3
from tests.integration.runner import TINY_ARCH, TINY_RUN, curve, run_cli, train_run, write_config
from tests.shards import random_docs, word_tokenizer, write_shard

pytestmark = pytest.mark.slow


def _train(cfg: Path, out: Path, nproc: int, cp: int, *extra: str) -> Path:
    return train_run(cfg, out, "--parallel.cp", str(cp), *extra, nproc=nproc)


def test_cp_runs_train_like_one_process_and_resume_across_layouts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "base", max_steps=4)  # fake data: documents of ~24 tokens in rows of 128
    _train(cfg, tmp_path / "one", 1, 1)
    _train(cfg, tmp_path / "cp2", 2, 2)
    _train(cfg, tmp_path / "cp2dp2", 4, 2)
    for key in ("loss/mean", "optim/grad_norm", "loss/tokens"):
        want = curve(tmp_path / "one", key)
        assert len(want) == 4
        for run in ("cp2", "cp2dp2"):
            assert curve(tmp_path / run, key) == pytest.approx(want, rel=1e-5, abs=1e-6), (run, key)
    # (dp 4, cp 1) -> (dp 2, cp 2) -> (dp 1, cp 4) on 4 processes: steps 1-2, 3 and 4 each in another layout,
    # each run resuming the previous layout's checkpoint
    _train(cfg, tmp_path / "dp4", 4, 1, "--ckpt.interval", "1", "--ckpt.keep-last", "4")
    _train(cfg, tmp_path / "dp2cp2", 4, 2, "--ckpt.interval", "1", "--ckpt.keep-last", "4", "--resume.step", "2",
           "--resume.path", str(tmp_path / "dp4"))  # fmt: skip
    _train(cfg, tmp_path / "cp4", 4, 4, "--resume.step", "3", "--resume.path", str(tmp_path / "dp2cp2"))
    got = [*curve(tmp_path / "dp4", "loss/mean")[:2], curve(tmp_path / "dp2cp2", "loss/mean")[0],
           *curve(tmp_path / "cp4", "loss/mean")]  # fmt: skip
    assert got == pytest.approx(curve(tmp_path / "one", "loss/mean"), rel=1e-5)


def test_sliding_windows_and_yarn_train_like_one_process_under_cp_and_fsdp(tmp_path: Path) -> None:
    # Qwen3 with one 8-key sliding-window block and one full block, and YaRN positions: documents of ~24 tokens
    # cross the window and the chunk boundaries.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    windows = tiny_qwen3(max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
                         layer_types=("sliding_attention", "full_attention"), rope_scaling=yarn)  # fmt: skip
    cfg, full = tmp_path / "windows.toml", tmp_path / "full.toml"
    for path, arch in ((cfg, windows), (full, tiny_qwen3(max_position_embeddings=256, rope_scaling=yarn))):
        run = TINY_RUN.format(max_steps=3, output_dir=(tmp_path / path.stem).as_posix())
        path.write_text(run.replace(TINY_ARCH, arch_toml(arch)))
    _train(cfg, tmp_path / "one", 1, 1)
    _train(cfg, tmp_path / "cp2", 2, 2)
    _train(cfg, tmp_path / "dp2", 2, 1)
    _train(full, tmp_path / "full", 1, 1)
    for key in ("loss/mean", "optim/grad_norm", "loss/tokens"):
        want = curve(tmp_path / "one", key)
        assert len(want) == 3
        for run_dir in ("cp2", "dp2"):
            assert curve(tmp_path / run_dir, key) == pytest.approx(want, rel=1e-5, abs=1e-6), (run_dir, key)
    # The window is in effect: the same run without it trains to other losses after the first step.
    assert curve(tmp_path / "full", "loss/mean")[1:] != pytest.approx(curve(tmp_path / "one", "loss/mean")[1:],
                                                                      rel=1e-4)  # fmt: skip


def test_validation_under_cp_equals_one_process(tmp_path: Path) -> None:
    validation_matches_one_process(tmp_path, ("--parallel.cp", "2"))


def validation_matches_one_process(
    tmp_path: Path, layout: tuple[str, ...], arch: AnyArch | None = None, worker: bool = True, nproc: int = 2
) -> None:
    """Held-out token sets, every set-file convention and (with `worker`) `lmforge eval` give on `nproc` processes
    in `layout` (one CP or TP group, 2 HSDP replica groups, 2 pipeline stages, ...) the numbers they give on one
    process, for the tiny Llama or `arch`."""
    tok = word_tokenizer(tmp_path / "tok")
    write_shard(tmp_path / "heldout", "00000", random_docs(40, seed=5))
    sets, rng = tmp_path / "sets", np.random.default_rng(0)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(1, 200, size=n))  # noqa: E731
    write_jsonl(sets / "words.ppl.jsonl", [{"text": words(int(n))} for n in rng.integers(3, 90, size=10)])
    quiz = [{"context": words(7), "continuations": [" " + words(2) for _ in "abc"], "label": i % 3} for i in range(9)]
    write_jsonl(sets / "quiz.ctxcont.jsonl", quiz)
    write_jsonl(sets / "minimal.pairs.jsonl", [{"good": words(4), "bad": words(4)} for _ in range(7)])
    shutil.copy(sets / "words.ppl.jsonl", sets / "words_h.ppl.jsonl")
    cfg = write_config(tmp_path, "base", max_steps=2, arch=arch)
    val = ["--tokenizer.name", str(tok), "--val.seq-lens", "[16, 64]", "--val.data-dir", str(sets), "--val.sets",
           f'[{{name = "held", path = "{tmp_path / "heldout"}"}}, "words", "quiz", "minimal", '
           '{name = "words_h", convention = "lmeval"}]']  # fmt: skip
    train_run(cfg, tmp_path / "one", *val, "--val.save-arrays")
    train_run(cfg, tmp_path / "cp2", *layout, *val, "--val.save-arrays", nproc=nproc)
    for name in ("quiz@64.npz", "words_h@16.npz"):  # written once per group, with the same scores
        one, two = (np.load(tmp_path / run / "val_arrays" / "step_2" / name) for run in ("one", "cp2"))
        np.testing.assert_allclose(two["loglik"], one["loglik"], rtol=0, atol=1e-5)
    (want,) = [r for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if "time/val" in r]
    (got,) = [r for r in read_metrics(tmp_path / "cp2" / "metrics.jsonl") if "time/val" in r]
    keys = [k for k in want if k.startswith("val/")]
    assert len(keys) > 20 and "val/words_h/word_perplexity@16" in keys and "val/held/bpb@64" in keys
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    if not worker:
        return
    # lmforge eval scores the snapshots of a run in its layout too (2 processes: one group)
    train_run(cfg, tmp_path / "snap", *layout, *val, "--eval-snapshots.interval", "2", "--no-val.eval-on-end",
              nproc=nproc)  # fmt: skip
    run = run_cli(["eval", str(tmp_path / "snap"), "--poll-seconds", "0.1"], nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    (scored,) = [r for r in read_metrics(tmp_path / "snap" / "metrics.jsonl") if "time/val" in r]
    for key in keys:
        assert scored[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_an_sft_run_under_cp_equals_one_process(tmp_path: Path) -> None:
    sft_matches_one_process(tmp_path, ("--parallel.cp", "2"))


def sft_matches_one_process(tmp_path: Path, layout: tuple[str, ...]) -> None:
    """An SFT run with held-out samples trains on 2 processes in `layout` (one CP or TP group) as on one."""
    tok = chat_tokenizer(tmp_path / "tok")
    rows = [{"messages": conversation(i, turns=1 + i % 3, system=i % 2 == 0)} for i in range(40)]
    write_jsonl(tmp_path / "chat" / "train.jsonl", rows[:32])
    write_jsonl(tmp_path / "chat" / "val.jsonl", rows[32:])
    cfg = tmp_path / "sft.toml"
    cfg.write_text(f"""
max_steps = 3
[tokenizer]
name = "{tok.as_posix()}"
{TINY_ARCH}
[data]
type = "sft"
paths = ["{(tmp_path / "chat" / "train.jsonl").as_posix()}"]
seq_len = 128
batch_tokens = 512
micro_batch_tokens = 256
max_epochs = 4
[val]
data = "{(tmp_path / "chat" / "val.jsonl").as_posix()}"
[optim]
lr = 3e-3
""")
    train_run(cfg, tmp_path / "one")
    train_run(cfg, tmp_path / "cp2", *layout, nproc=2)
    for key in ("loss/mean", "optim/grad_norm", "loss/tokens", "val/loss"):
        want = curve(tmp_path / "one", key)
        assert want, key
        assert curve(tmp_path / "cp2", key) == pytest.approx(want, rel=1e-5, abs=1e-6), key
