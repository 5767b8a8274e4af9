"""A checkpoint written by an earlier lmforge resumes in this one and continues that run exactly.

`tests/data/checkpoint_25e17d0/` was made by lmforge at commit 25e17d0 (before the package was reorganized into
`config/`, `hf/`, `checkpoint/` and `parallel/` homes): `lmforge train @ run.toml` with OMP_NUM_THREADS=1, a tiny
GLM-4.5-style MoE on generated data with Muon and sign-rule bias balancing, checkpointed at step 4 of 8.
`reference.json` holds the metrics of the same run left uninterrupted. The checkpoint carries what a layout change
could break: DCP shards of the model and of both optimizers (Muon and AdamW), the MoE selection biases, the RNG
state, and the trainer state with a callback's history.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.monitor import read_metrics
from tests.integration.runner import run_cli

pytestmark = pytest.mark.slow

OLD = Path(__file__).parents[1] / "data" / "checkpoint_25e17d0"


def test_a_checkpoint_of_an_earlier_version_resumes_the_run(tmp_path: Path) -> None:
    reference = {int(step): r for step, r in json.loads((OLD / "reference.json").read_text())["steps"].items()}
    out = tmp_path / "resumed"
    args = ["train", "@", str(OLD / "run.toml"), "--output-dir", str(out), "--resume.path", str(OLD / "step_4"),
            "--resume.step", "4", "--no-ckpt.final"]  # fmt: skip
    result = run_cli(args)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [5, 6, 7, 8], result.stdout[-2000:]
    for record in records:
        expected = reference[record["step"]]
        assert record["optim/lr"] == expected["optim/lr"]
        # The same steps the earlier version took: weights, both optimizers' state, the routing biases and the
        # data position all came back (a lost optimizer state or bias moves the loss by far more).
        for key in ("loss/mean", "optim/grad_norm", "moe/bias/abs_mean"):
            assert record[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), (record["step"], key)
