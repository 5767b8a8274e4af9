"""A disk that fills up during a checkpoint save: the run stops with one clear message, `latest` still names the
last good checkpoint, nothing partial is left, and the relaunch continues exactly."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from lmforge.checkpoint.layout import is_complete, list_checkpoints, read_latest, step_name
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


def test_a_real_small_file_system_fills_up(tmp_path: Path) -> None:
    mount = tmp_path / f"small-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    # 2 MiB: one checkpoint of this model (1.2 MB) and the run's small files fit; a second one next to it does not.
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}); the injected-ENOSPC test covers it")
    try:
        cfg = write_config(mount, "run", max_steps=STEPS)
        result = run_cli(["train", "@", str(cfg), "--ckpt.interval", "2", "--ckpt.keep-last", "1"])
        # Which write meets the full disk decides the error's own words; the note says what it means.
        _assert_stopped_cleanly(result, mount / "run", failed=4, kept=2, cause="(the disk is full: ")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
