"""`[eval_snapshots]` and `lmforge eval`: every snapshot scored once at its step, deleted, and a restart goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.monitor import read_metrics
from lmforge.monitor.wandb import EVAL_RUN_ID_FILE
from tests.chat import write_jsonl
from tests.conftest import require
from tests.integration.runner import losses, run_cli, write_config
from tests.shards import random_docs, word_tokenizer, write_shard
from tests.unit.test_wandb import logged_runs, stored_id

pytestmark = pytest.mark.slow


def test_worker_scores_each_snapshot_once_like_the_trainer_would(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path / "tok")
    write_shard(tmp_path / "heldout", "00000", random_docs(40, seed=5))
    # set files scored by lm-evaluation-harness's rules too: the worker builds them from the run's config
    words = [" ".join(f"w{(7 * i + k) % 290 + 1}" for k in range(3 + 5 * i)) for i in range(8)]
    write_jsonl(tmp_path / "sets" / "words.ppl.jsonl", [{"text": w} for w in words])
    quiz = [{"context": w, "continuations": ["w1 w2", "w3"], "label": i % 2, "target_delimiter": " "}
            for i, w in enumerate(words)]  # fmt: skip
    write_jsonl(tmp_path / "sets" / "quiz.ctxcont.jsonl", quiz)
    cfg = write_config(tmp_path, "base", max_steps=6)
    common = ["train", "@", str(cfg), "--tokenizer.name", str(tok), "--val.seq-lens", "[32]",
              "--val.sets", f'[{{name = "held", path = "{tmp_path / "heldout"}"}}, "words", "quiz"]',
              "--val.data-dir", str(tmp_path / "sets"), "--val.convention", "lmeval"]  # fmt: skip
    # The reference: the trainer scores the same sets itself at steps 2, 4, 6.
    inline = run_cli([*common, "--output-dir", str(tmp_path / "inline"), "--val.interval", "2"])
    assert inline.returncode == 0, inline.stderr[-3000:]
    run = tmp_path / "snap"
    trained = run_cli([*common, "--output-dir", str(run), "--no-val.eval-on-end", "--eval-snapshots.interval", "2"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert losses(run) == losses(tmp_path / "inline"), "snapshots do not change training"
    assert sorted(p.name for p in (run / "snapshots").iterdir() if p.name.startswith("step_")) == [
        "step_2", "step_4", "step_6"
    ]  # fmt: skip
    assert not [r for r in read_metrics(run / "metrics.jsonl") if "time/val" in r]
    # A worker that stops after one snapshot (as if killed), then a second one that finishes the run.
    first = run_cli(["eval", str(run), "--limit", "1", "--poll-seconds", "0.1"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (run / "snapshots" / "step_2").exists() and (run / "snapshots" / "step_4").exists()
    second = run_cli(["eval", str(run), "--poll-seconds", "0.1"], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not [p for p in (run / "snapshots").iterdir() if p.name.startswith("step_")]
    scored = [r for r in read_metrics(run / "metrics.jsonl") if "time/val" in r]
    expected = [r for r in read_metrics(tmp_path / "inline" / "metrics.jsonl") if "time/val" in r]
    assert [r["step"] for r in scored] == [2, 4, 6], "each snapshot once, at its own step"
    for got, want in zip(scored, expected, strict=True):
        assert got["val/held/loss@32"] == pytest.approx(want["val/held/loss@32"], rel=1e-5, abs=1e-6)
        assert got["val/held/bpb@32"] == pytest.approx(want["val/held/bpb@32"], rel=1e-5, abs=1e-6)
        for key in ("val/words/word_perplexity@32", "val/words/bpb@32", "val/quiz/acc_norm@32"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    # `eval --model`: the final weights, exported, scored once on the run's [val] sets, as the trainer scored them
    export = tmp_path / "export"
    assert run_cli(["export", str(tmp_path / "inline"), "-o", str(export), "--dtype", "float32"]).returncode == 0
    once = run_cli(["eval", "--model", str(export), "--config", str(tmp_path / "inline" / "config.toml"),
                    "--json", str(tmp_path / "once.json")])  # fmt: skip
    assert once.returncode == 0, once.stderr[-3000:]
    scored_once = json.loads((tmp_path / "once.json").read_text())
    final = expected[-1]
    for key in ("val/held/loss@32", "val/held/bpb@32", "val/words/word_perplexity@32", "val/quiz/acc_norm@32"):
        assert scored_once[key] == pytest.approx(final[key], rel=1e-5, abs=1e-6), key
    assert f"val/held/loss@32 {final['val/held/loss@32']:.4f}" in once.stdout


def test_worker_refuses_a_run_without_val_sets(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "bare", max_steps=2)
    assert run_cli(["train", "@", str(cfg)]).returncode == 0
    result = run_cli(["eval", str(tmp_path / "bare")])
    assert result.returncode == 2 and "no [val] sets" in result.stderr
    missing = run_cli(["eval", str(tmp_path / "nowhere")])
    assert missing.returncode == 2 and "not a run directory" in missing.stderr
    no_config = run_cli(["eval", "--model", str(tmp_path / "bare")])
    assert no_config.returncode == 2 and "--model takes --config CONFIG" in no_config.stderr
    not_model = run_cli(["eval", "--model", str(tmp_path / "bare"), "--config", str(cfg)])
    assert not_model.returncode == 2 and "not a model folder (no config.json)" in not_model.stderr
    neither = run_cli(["eval"])
    assert neither.returncode == 2 and "give a run directory" in neither.stderr


def test_worker_logs_to_a_wandb_run_beside_the_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `[wandb]` offline, the worker's metrics reach a W&B run of its own (`<name>-eval`, job type eval) at
    the snapshots' steps, and its config names the training's W&B run."""
    require("wandb")
    for name, value in {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                        "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_MACHINE_INFO": "true",
                        "WANDB__DISABLE_META": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache")}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    tok = word_tokenizer(tmp_path / "tok")
    write_shard(tmp_path / "heldout", "00000", random_docs(30, seed=5))
    cfg = write_config(tmp_path, "base", max_steps=4)
    run = tmp_path / "run"
    trained = run_cli(["train", "@", str(cfg), "--tokenizer.name", str(tok), "--val.seq-lens", "[32]", "--val.sets",
                       f'[{{name = "held", path = "{tmp_path / "heldout"}"}}]', "--output-dir", str(run),
                       "--no-val.eval-on-end", "--eval-snapshots.interval", "2", "--wandb.project", "lmforge-test",
                       "--wandb.mode", "offline"])  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    worker = run_cli(["eval", str(run), "--poll-seconds", "0.1"])
    assert worker.returncode == 0, worker.stderr[-3000:]
    scored = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "time/val" in r}
    assert sorted(scored) == [2, 4]
    eval_id = (run / EVAL_RUN_ID_FILE).read_text().strip()
    assert eval_id != stored_id(run)
    (logged,) = logged_runs(run, eval_id)
    assert logged.run.display_name == "run-eval" and logged.run.job_type == "eval"
    assert logged.config["train_run_id"] == stored_id(run)
    assert sorted(logged.history) == [2, 4]
    for step, row in logged.history.items():
        assert row["val/held/loss@32"] == pytest.approx(scored[step]["val/held/loss@32"])
