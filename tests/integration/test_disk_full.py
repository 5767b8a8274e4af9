"""A disk that fills up during a checkpoint save: the run stops with one clear message, `latest` still names the
last good checkpoint, nothing partial is left, and the relaunch continues exactly."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmforge.checkpoint.layout import is_complete, list_checkpoints, read_latest, step_name
from lmforge.monitor import read_metrics
from tests.integration.runner import cli_command, env_one_thread, losses, run_cli, write_config

pytestmark = pytest.mark.slow

CHAOS_RUN = Path(__file__).parents[1] / "chaos" / "chaos_run.py"
STEPS = 8


def _assert_stopped_cleanly(
    result: subprocess.CompletedProcess[str], run: Path, failed: int, kept: int, cause: str, torchrun: bool = False
) -> None:
    # Under torchrun the launcher exits 1 and prints its own report of the failed workers after their message.
    assert result.returncode == (1 if torchrun else 2), result.stderr[-3000:]
    message = [line for line in result.stderr.splitlines() if "lmforge train: error:" in line]
    assert len(message) == 1, result.stderr[-3000:]
    assert torchrun or "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"saving checkpoint {step_name(failed)} into {run / 'checkpoints'} failed: " in message[0], message[0]
    assert cause in message[0], message[0]
    assert f"its partial files were removed and latest still names {step_name(kept)}" in message[0]
    root = run / "checkpoints"
    assert read_latest(root) == kept and is_complete(root / step_name(kept))
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert list_checkpoints(root)[-1] == kept


@pytest.mark.parametrize(("nproc", "async_save"), [(1, False), (1, True), (2, False)])
def test_a_full_disk_during_a_save_stops_the_run_and_keeps_latest(tmp_path: Path, nproc: int, async_save: bool) -> None:
    reference = write_config(tmp_path, "reference", max_steps=STEPS)
    flags = ["--ckpt.interval", "2", *(["--ckpt.async"] if async_save else [])]
    assert run_cli(["train", "@", str(reference), *flags], nproc=nproc).returncode == 0
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    # This item of rank 0's writes falls in the second save (step 4): rank 0 writes 125 items a save on one
    # process, 49 on two (counted on this config).
    item = {1: 150, 2: 60}[nproc]
    args = ["enospc", str(item), "train", "@", str(cfg), *flags, "--resume.step", "auto"]
    env = {**env_one_thread(), "CHAOS_RANK": "0"}
    result = subprocess.run(cli_command(args, nproc=nproc, script=CHAOS_RUN), capture_output=True, text=True,
                            timeout=240, env=env, check=False)  # fmt: skip
    enospc = "OSError: [Errno 28] No space left on device"
    _assert_stopped_cleanly(result, tmp_path / "run", failed=4, kept=2, cause=enospc, torchrun=nproc == 2)
    # Space again: the same command continues from step 2 and ends as the uninterrupted run.
    again = run_cli(["train", "@", str(cfg), *flags, "--resume.step", "auto"], nproc=nproc)
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted under `tmp_path` for the test (skipped where the machine lets no test mount one;
    the injected failures cover that case), unmounted after."""
    mount = tmp_path / f"small-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}); the injected failures cover it")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_small_file_system_fills_up(tmp_path: Path) -> None:
    # 2 MiB: one checkpoint of this model (1.2 MB) and the run's small files fit; a second one next to it does not.
    with small_tmpfs(tmp_path, "2m") as mount:
        cfg = write_config(mount, "run", max_steps=STEPS)
        result = run_cli(["train", "@", str(cfg), "--ckpt.interval", "2", "--ckpt.keep-last", "1"])
        # Which write meets the full disk decides the error's own words; the note says what it means.
        _assert_stopped_cleanly(result, mount / "run", failed=4, kept=2, cause="(the disk is full: ")


FAULTY = Path(__file__).with_name("faulty_run.py")


def _assert_record_stopped(result: subprocess.CompletedProcess[str], file: Path, failed: int, kept: int,
                           torchrun: bool = False) -> None:  # fmt: skip
    assert result.returncode == (1 if torchrun else 2), result.stderr[-3000:]
    message = [line for line in result.stderr.splitlines() if "lmforge train: error:" in line]
    assert len(message) == 1, result.stderr[-3000:]
    assert torchrun or "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "Logging error" not in result.stderr, result.stderr[-3000:]
    assert f"writing {file} failed" in message[0] and "[Errno 28] No space left on device" in message[0], message[0]
    assert f"training stopped after step {failed}: continue from {step_name(kept)}" in message[0], message[0]


@pytest.mark.parametrize(("fault", "nproc"), [("record-full", 1), ("log-full", 2)])
def test_a_record_that_cannot_be_written_stops_the_run_and_a_relaunch_continues_it(
    tmp_path: Path, fault: str, nproc: int
) -> None:
    """metrics.jsonl (rank 0) or a rank log (rank 1 of two) meets a full disk at step 5: every rank stops in the
    next step with one line naming the file, no checkpoint after the last recorded step is committed, and the same
    command continues the run as if nothing had happened."""
    flags = ["--ckpt.interval", "2", "--log.interval", "1"]
    reference = write_config(tmp_path, "reference", max_steps=STEPS)
    assert run_cli(["train", "@", str(reference), *flags], nproc=nproc).returncode == 0
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    run = tmp_path / "run"
    args = [fault, "5", "train", "@", str(cfg), *flags, "--resume.step", "auto"]
    env = {**env_one_thread(), **({"FAULT_RANK": "1"} if nproc == 2 else {})}
    result = subprocess.run(cli_command(args, nproc=nproc, script=FAULTY), capture_output=True, text=True,
                            timeout=240, env=env, check=False)  # fmt: skip
    file = run / "metrics.jsonl" if fault == "record-full" else run / "logs" / "rank_1.log"
    _assert_record_stopped(result, file, failed=5, kept=4, torchrun=nproc == 2)
    root = run / "checkpoints"
    assert read_latest(root) == 4 and list_checkpoints(root) == [2, 4]
    again = run_cli(["train", "@", str(cfg), *flags, "--resume.step", "auto"], nproc=nproc)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(STEPS + 1))
    assert losses(run) == losses(tmp_path / "reference")


def test_metrics_on_a_real_full_file_system_stop_the_run(tmp_path: Path) -> None:
    # One 4 KiB page: the record of step 0 (parameter counts, ~1 KiB) and a few steps fit, then the disk is full.
    with small_tmpfs(tmp_path, "4k") as mount:
        flags = ["--ckpt.interval", "2", "--log.interval", "1"]
        reference = write_config(tmp_path, "reference", max_steps=STEPS)
        assert run_cli(["train", "@", str(reference), *flags]).returncode == 0
        cfg = write_config(tmp_path, "run", max_steps=STEPS)
        run = tmp_path / "run"
        run.mkdir()
        (run / "metrics.jsonl").symlink_to(mount / "metrics.jsonl")  # the record lives on the small file system
        result = run_cli(["train", "@", str(cfg), *flags])
        recorded = [r["step"] for r in read_metrics(mount / "metrics.jsonl")]
        failed = recorded[-1] + 1
        assert recorded == list(range(failed)) and 3 <= failed < STEPS, recorded
        assert (mount / "metrics.jsonl").read_text().endswith("\n")  # the cut-off line was taken back
        kept = (failed - 1) // 2 * 2  # the last checkpoint whose step was recorded
        _assert_record_stopped(result, run / "metrics.jsonl", failed=failed, kept=kept)
        assert read_latest(run / "checkpoints") == kept
        # Room again (the resume rewrites the record on the run's own disk): the run continues exactly.
        again = run_cli(["train", "@", str(cfg), *flags, "--resume.step", "latest"])
        assert again.returncode == 0, again.stderr[-3000:]
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(STEPS + 1))
        assert losses(run) == losses(tmp_path / "reference")
