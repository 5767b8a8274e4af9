"""Tests that need a dev dependency skip without it on a developer's machine, but fail under CI, where every dev
dependency is installed: a torchao release built for another torch must turn the FP8 tests red, not into skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _fp8_tests_without_torchao(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    """tests/unit/test_fp8.py run with a `torchao` on the path that raises on import, ahead of the installed one."""
    shadow = tmp_path / "shadow" / "torchao"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('torchao made unimportable by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)]), "CI": "true" if ci else ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_fp8.py"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
def test_under_ci_the_fp8_tests_fail_when_torchao_does_not_import(tmp_path: Path) -> None:
    result = _fp8_tests_without_torchao(tmp_path, ci=True)
    assert result.returncode not in (0, 5), result.stdout[-2000:]
    assert "torchao made unimportable by the test" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]


@pytest.mark.slow
def test_elsewhere_they_skip(tmp_path: Path) -> None:
    result = _fp8_tests_without_torchao(tmp_path, ci=False)
    assert result.returncode == 5, result.stdout[-2000:]  # pytest's "no test ran": the module was skipped whole
    assert "skipped" in result.stdout.splitlines()[-1] and "passed" not in result.stdout.splitlines()[-1]
