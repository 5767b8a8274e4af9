"""`lmforge train` end to end: outputs, errors, and equal losses on 1 and 2 ranks."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from lmforge.monitor import read_metrics
from tests.conftest import require
from tests.integration.runner import losses, run_cli, write_config

pytestmark = pytest.mark.slow


def test_train_writes_config_and_metrics(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=4)
    result = run_cli(["train", "@", str(cfg), "--log.interval", "2"])
    assert result.returncode == 0, result.stderr
    out = tmp_path / "run"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 4]  # step 0: the parameter counts
    assert all(r["loss/mean"] > 0 for r in records[1:])
    assert "step 4/4" in result.stdout
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert resolved["log"]["interval"] == 2 and resolved["data"]["seq_len"] == 64
    # The resolved config is itself a valid input that describes the same run.
    again = run_cli(["train", "@", str(out / "config.toml"), "--dry-run"])
    assert again.returncode == 0 and tomllib.loads(again.stdout) == resolved


def test_rerun_into_a_used_output_dir_is_refused(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=1)
    assert run_cli(["train", "@", str(cfg)]).returncode == 0
    second = run_cli(["train", "@", str(cfg)])
    assert second.returncode == 2 and "already holds a run" in second.stderr and "Traceback" not in second.stderr


def test_resuming_a_finished_run_says_there_is_nothing_left(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=2)
    assert run_cli(["train", "@", str(cfg)]).returncode == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = run_cli(["train", "@", str(cfg), "--resume.step", "latest"])
    assert again.returncode == 0, again.stderr
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    assert f"{checkpoint} is at step 2, and max_steps is 2: nothing left to train" in again.stdout
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # no step ran, nothing was logged


def test_bad_config_exits_with_one_message_and_no_traceback(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run")
    result = run_cli(["train", "@", str(cfg), "--data.seq-len", "4096"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "data.seq_len (from the command line)" in result.stderr
    assert "max_position_embeddings" in result.stderr
    assert not (tmp_path / "run").exists()


def test_sft_script_is_the_same_trainer(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.integration.runner import env_one_thread

    sft = Path(sys.executable).parent / "sft"
    assert sft.exists(), "the package installs an `sft` console script"
    cfg = write_config(tmp_path, "run")
    result = subprocess.run([str(sft), "@", str(cfg), "--dry-run"], capture_output=True, text=True, timeout=60,
                            env=env_one_thread(), check=False)  # fmt: skip
    assert result.returncode == 0 and "max_steps = 6" in result.stdout


@pytest.mark.parametrize("defer", [False, True], ids=["sync-every-micro-batch", "defer-grad-sync"])
def test_two_ranks_match_one_rank(tmp_path: Path, defer: bool) -> None:
    cfg = write_config(tmp_path, "base", max_steps=6)
    flag = "--model.defer-grad-sync" if defer else "--no-model.defer-grad-sync"
    one = run_cli(["train", "@", str(cfg), flag, "--output-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    two = run_cli(["train", "@", str(cfg), flag, "--output-dir", str(tmp_path / "two")], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    assert a[-1] < a[0]  # it trains
    tokens = [r["progress/num_tokens"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl") if r["step"] > 0]
    assert tokens[-1] == 6 * 1024


def test_wandb_offline_run_and_rank_logs(tmp_path: Path) -> None:
    require("wandb")
    cfg = write_config(tmp_path, "run", max_steps=3)
    flags = ["--wandb.project", "lmforge-test", "--wandb.mode", "offline"]
    result = run_cli(["train", "@", str(cfg), *flags], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run"
    run_id = (out / "wandb_run_id").read_text().strip()
    assert [p.name for p in (out / "wandb").glob(f"offline-run-*-{run_id}")], "rank 0 wrote one offline W&B run"
    for rank in (0, 1):
        log = (out / "logs" / f"rank_{rank}.log").read_text()
        assert f"rank {rank} of 2" in log and "step 3/3" in log


def test_chunked_loss_trains_like_the_full_logits_on_two_ranks(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "base", max_steps=4)
    # loss_chunk_tokens = 0 is the full-logits path (`auto` is chunked on the CPU too).
    plain = run_cli(["train", "@", str(cfg), "--output-dir", str(tmp_path / "plain"), "--model.loss-chunk-tokens",
                     "0"], nproc=2)  # fmt: skip
    chunked = run_cli(["train", "@", str(cfg), "--output-dir", str(tmp_path / "chunked"),
                       "--model.loss-chunk-tokens", "48"], nproc=2)  # fmt: skip
    assert plain.returncode == 0 and chunked.returncode == 0, chunked.stderr[-3000:]
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "chunked")
    assert len(a) == 4 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    # Each side took the path it names: the rank logs say which.
    for run, path in (("plain", "full logits"), ("chunked", "chunks of 48")):
        assert path in (tmp_path / run / "logs" / "rank_0.log").read_text(), run
