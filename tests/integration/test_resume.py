"""Checkpoints through the real CLI: exact resume on 1 and 2 ranks and across world sizes, crash safety,
preemption by signal, and retention."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lmforge.checkpoint.layout import list_checkpoints, read_latest
from lmforge.monitor import read_metrics
from tests.integration.runner import cli_command, env_one_thread, losses, run_cli, write_config

pytestmark = pytest.mark.slow

FAULTY = Path(__file__).with_name("faulty_run.py")
STEPS = 40


def _train(cfg: Path, *flags: str, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    result = run_cli(["train", "@", str(cfg), *flags], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """40-step runs on 1 and 2 ranks, checkpointing every 20 steps."""
    tmp = tmp_path_factory.mktemp("straight")
    runs = {}
    for nproc in (1, 2):
        cfg = write_config(tmp, f"ws{nproc}", max_steps=STEPS)
        _train(cfg, "--ckpt.interval", "20", nproc=nproc)
        runs[nproc] = tmp / f"ws{nproc}"
    return runs


def _resume(tmp_path: Path, source: Path, nproc: int, step: int = 20) -> list[float]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = write_config(tmp_path, "resumed", max_steps=STEPS)
    result = _train(cfg, "--resume.path", str(source), "--resume.step", str(step), nproc=nproc)
    records = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(step + 1, STEPS + 1)), result.stdout[-2000:]
    return [r["loss/mean"] for r in records]


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_reproduces_the_run_bitwise(straight: dict[int, Path], tmp_path: Path, nproc: int) -> None:
    run = straight[nproc]
    assert list_checkpoints(run / "checkpoints") == [20, 40] and read_latest(run / "checkpoints") == 40
    reference = read_metrics(run / "metrics.jsonl")[1:]  # after the step-0 record (parameter counts)
    resumed = _resume(tmp_path, run, nproc)
    assert resumed == [r["loss/mean"] for r in reference[20:]]
    # Learning rate and token counter continue exactly too.
    records = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    for mine, theirs in zip(records, reference[20:], strict=True):
        assert mine["optim/lr"] == theirs["optim/lr"]
        assert mine["progress/num_tokens"] == theirs["progress/num_tokens"]


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size(straight: dict[int, Path], tmp_path: Path, saved: int, resumed: int) -> None:
    losses_resumed = _resume(tmp_path, straight[saved], resumed)
    reference = losses(straight[saved])[20:]
    assert max(abs(a - b) for a, b in zip(losses_resumed, reference, strict=True)) < 1e-5


def test_killed_while_saving_leaves_the_previous_checkpoint(straight: dict[int, Path], tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    args = ["hang-in-commit", "30", "train", "@", str(cfg), "--ckpt.interval", "10"]
    proc = subprocess.Popen(cli_command(args, script=FAULTY), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env_one_thread())  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "HANG":
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    root = tmp_path / "run" / "checkpoints"
    assert read_latest(root) == 20 and list_checkpoints(root) == [10, 20]
    assert (root / ".tmp_step_30" / ".metadata").is_file(), "the kill came after the shards were written"
    again = _train(cfg, "--ckpt.interval", "10", "--resume.step", "latest")
    assert "Traceback" not in again.stderr
    assert not (root / ".tmp_step_30").exists() and list_checkpoints(root) == [30, 40]
    # The run continued from step 20; its curve is one run's, equal to the uninterrupted run's.
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(STEPS + 1))
    assert losses(tmp_path / "run") == losses(straight[1])


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_checkpoints_and_exits_zero(straight: dict[int, Path], tmp_path: Path, nproc: int) -> None:
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    # Under torchrun only rank 1 is signalled: both ranks must still stop after the same step.
    fault_env = {"FAULT_RANK": "1"} if nproc == 2 else {}
    cmd = cli_command(["sigterm", "13", "train", "@", str(cfg)], nproc=nproc, script=FAULTY)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**env_one_thread(), **fault_env},
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    stopped = read_latest(root)
    assert stopped is not None and 13 <= stopped < STEPS
    assert f"stopped after step {stopped}" in result.stdout and "--resume.step latest" in result.stdout
    assert json.loads((root / f"step_{stopped}" / "trainer.json").read_text())["step"] == stopped
    # `auto` (relaunch-safe) finds the same checkpoint that `latest` names.
    _train(cfg, "--resume.step", "latest" if nproc == 1 else "auto", nproc=nproc)
    assert losses(tmp_path / "run") == losses(straight[nproc])


def test_second_signal_exits_at_once_without_touching_the_last_checkpoint(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    args = ["sigterm-twice", "13", "train", "@", str(cfg), "--ckpt.interval", "10"]
    t0 = time.perf_counter()
    result = run_cli(args, script=FAULTY)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert time.perf_counter() - t0 < 60 and "exiting now" in result.stderr
    root = tmp_path / "run" / "checkpoints"
    assert read_latest(root) == 10 and list_checkpoints(root) == [10]


def test_retention_keeps_the_last_and_the_interval_multiples(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=10)
    _train(cfg, "--ckpt.interval", "1", "--ckpt.keep-last", "2", "--ckpt.keep-interval", "4")
    root = tmp_path / "run" / "checkpoints"
    assert list_checkpoints(root) == [4, 8, 9, 10] and read_latest(root) == 10
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_10", "step_4", "step_8", "step_9"]


def test_async_save_gives_the_same_checkpoints(straight: dict[int, Path], tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    _train(cfg, "--ckpt.interval", "20", "--ckpt.async")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "time/save_ckpt" in r] == [20, 40]
    assert losses(tmp_path / "run") == losses(straight[1])
    resumed = _resume(tmp_path / "again", tmp_path / "run", 1)
    assert resumed == losses(straight[1])[20:]


def test_resume_errors_name_what_is_wrong(straight: dict[int, Path], tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    missing = run_cli(["train", "@", str(cfg), "--resume.path", str(straight[1]), "--resume.step", "30"])
    assert missing.returncode == 2 and "no complete checkpoint for step 30" in missing.stderr
    assert "20, 40" in missing.stderr and "Traceback" not in missing.stderr
    nothing = run_cli(["train", "@", str(cfg), "--resume.step", "latest"])
    assert nothing.returncode == 2 and "has no checkpoint" in nothing.stderr
    wider = run_cli(["train", "@", str(cfg), "--resume.path", str(straight[1]), "--resume.step", "20",
                     "--model.arch.hidden-size", "96"])  # fmt: skip
    assert wider.returncode == 2 and "does not fit the configured model" in wider.stderr
    assert "model.embed_tokens.weight: checkpoint shape [256, 64], model shape [256, 96]" in wider.stderr
