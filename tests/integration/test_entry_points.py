"""Every way of starting lmforge runs the command, or refuses it loudly: the `lmforge` and `sft` scripts,
`python -m lmforge`, `python -m lmforge.cli` and torchrun."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.integration.runner import env_one_thread, write_config

pytestmark = pytest.mark.slow

SCRIPTS = Path(sys.executable).parent


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env_one_thread(), check=False)


def _entry(how: str) -> list[str]:
    if how == "lmforge":
        return [str(SCRIPTS / "lmforge")]
    if how == "sft":
        return [str(SCRIPTS / "sft")]
    if how == "module":
        return [sys.executable, "-m", "lmforge"]
    if how == "cli-module":
        return [sys.executable, "-m", "lmforge.cli"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "lmforge"]


@pytest.mark.parametrize("how", ["lmforge", "sft", "module", "cli-module", "torchrun"])
def test_each_entry_point_runs_the_command(tmp_path: Path, how: str) -> None:
    if how in ("lmforge", "sft") and not (SCRIPTS / how).is_file():
        pytest.skip(f"the {how} console script is not installed beside {sys.executable}")
    cfg = write_config(tmp_path, "run")
    args = ["@", str(cfg), "--max-steps", "7", "--dry-run"]
    result = _run([*_entry(how), *([] if how == "sft" else ["train"]), *args])
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["max_steps"] == 7  # the command ran: it printed the resolved config


@pytest.mark.parametrize("how", ["lmforge", "module", "cli-module"])
def test_an_unknown_command_is_refused(how: str) -> None:
    if how == "lmforge" and shutil.which("lmforge", path=str(SCRIPTS)) is None:
        pytest.skip("the lmforge console script is not installed")
    result = _run([*_entry(how), "trian", "@", "x.toml"])
    assert result.returncode == 2
    assert "lmforge trian: error: unknown command" in result.stderr and "train" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_command_prints_the_usage_and_fails() -> None:
    result = _run([sys.executable, "-m", "lmforge"])
    assert result.returncode == 2 and "usage: lmforge COMMAND" in result.stdout
    assert all(name in result.stdout for name in ("train", "export", "eval", "val-sets", "chat-set"))
