"""`lmforge demo` end to end on a shortened run: data preparation, training, and the closing sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.checkpoint.layout import read_latest
from lmforge.monitor import read_metrics
from tests.integration.runner import run_cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def test_demo_prepares_trains_and_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the demo reads examples/pretrain/demo.toml relative to the repository
    out = tmp_path / "run"
    args = ["demo", "--data-dir", str(tmp_path / "data"), "--max-steps", "3", "--output-dir", str(out)]
    result = run_cli(args, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_latest(out / "checkpoints") == 3
    final = read_metrics(out / "metrics.jsonl")[-1]  # the end-of-training validation round on the held-out scenes
    assert final["step"] == 3 and final["val/heldout/loss@256"] > 0 and "val/heldout/loss@256" in result.stdout
    assert "A sample from the trained model" in result.stdout
    sample = result.stdout.split("A sample from the trained model", 1)[1]
    assert "ROMEO:" in sample and len(sample.split("ROMEO:", 1)[1].strip()) > 0
