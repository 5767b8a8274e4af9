"""examples/pretrain/moe.toml as its comments say to run it, shortened: `lmforge demo --prepare-only` builds the
demo data under data/demo, then `lmforge train @ examples/pretrain/moe.toml` trains the GLM-4.5-style MoE on it
with the file's own data, tokenizer and held-out paths (relative to the working directory)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmforge.checkpoint.layout import read_latest
from lmforge.monitor import read_metrics
from tests.integration.runner import losses, run_cli

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parents[2] / "examples" / "pretrain" / "moe.toml"
STEPS = 4


def test_moe_example_trains_on_the_demo_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # data/demo and runs/moe, the example's relative paths, land in tmp_path
    prep = run_cli(["demo", "--prepare-only", "--config", str(EXAMPLE)], timeout=120)
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert (tmp_path / "data" / "demo" / "READY").is_file()

    # A tiny batch (two micro-batches of one 1024-token row each) keeps the run to a few seconds; a record every step.
    flags = ["--max-steps", str(STEPS), "--data.batch-tokens", "2048", "--data.micro-batch-tokens", "1024"]
    flags += ["--log.interval", "1"]
    result = run_cli(["train", "@", str(EXAMPLE), *flags], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "moe"
    assert read_latest(run / "checkpoints") == STEPS

    loss = losses(run)
    assert len(loss) == STEPS and all(math.isfinite(x) for x in loss)
    assert loss[-1] < loss[0] - 0.5, loss  # from ln(4096) = 8.3 the first steps fall fast

    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss/mean" in r]
    last = steps[-1]
    # Routing metrics of the three MoE blocks; block 0 is dense (first_k_dense_replace = 1).
    assert {"max_vio/mean", "expert_load/entropy/mean", "routing_confidence/mean"} <= last.keys()
    assert all(f"expert_load/layer_{i}/max_vio" in last for i in (1, 2, 3))
    assert "expert_load/layer_0/max_vio" not in last
    assert math.isfinite(last["max_vio/mean"]) and last["max_vio/mean"] >= 0
    assert last["moe/bias/abs_mean"] > 0  # [model.moe_balance] moved the selection biases

    final = records[-1]  # the end-of-training round on the held-out scenes of the demo corpus
    assert final["step"] == STEPS and math.isfinite(final["val/heldout/loss@256"])
    assert final["val/heldout/loss@256"] < math.log(4096)
