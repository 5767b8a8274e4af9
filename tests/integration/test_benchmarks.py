"""The benchmark scripts keep running (tiny sizes; their figures are recorded in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def test_overhead_smoke_trains_the_same_model_on_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--smoke", "--no-live-memory", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["best"]["lmforge"]["tokens_per_s"] > 0 and figures["best"]["plain"]["tokens_per_s"] > 0
    # both sides start from the same weights and data, so their losses agree
    assert figures["first_loss"]["lmforge"] == pytest.approx(figures["first_loss"]["plain"], abs=1e-6)
    assert figures["max_loss_diff"] < 1e-4
