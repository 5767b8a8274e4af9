"""Secrets in the environment stay out of everything a run and its report write, W&B's offline files included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require
from tests.integration.runner import run_cli, write_config

pytestmark = pytest.mark.slow

SECRETS = {
    "WANDB_API_KEY": "fake-secret-0123456789abcdef",
    "HF_TOKEN": "hf_fakeSecretToken0123456789abcdef",
    "HUGGING_FACE_HUB_TOKEN": "hf_fakeHubToken0123456789abcdef",
}


def _files_holding(root: Path, needles: list[bytes]) -> list[str]:
    """Every file under `root` (binary ones too, like W&B's run-*.wandb) whose bytes contain one of `needles`."""
    hits = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path.relative_to(root)}: {n.decode()}" for n in needles if n in data]
    return hits


@pytest.mark.timeout(300)
def test_secrets_stay_out_of_the_run_and_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("wandb")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    # Every folder W&B and its service may write to, inside tmp_path so the search below sees all of it.
    home = tmp_path / "home"
    folders = {"WANDB_DIR": "wandb", "WANDB_CACHE_DIR": "cache/wandb", "WANDB_CONFIG_DIR": "config",
               "WANDB_DATA_DIR": "data", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config"}  # fmt: skip
    for var, sub in folders.items():
        (home / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(home / sub))
    cfg = write_config(tmp_path, "run", max_steps=2)
    flags = ["--wandb.project", "lmforge-test", "--wandb.mode", "offline", "--wandb.tags", '["security"]']
    train = run_cli(["train", "@", str(cfg), *flags], timeout=240)
    assert train.returncode == 0, train.stderr[-3000:]
    run = tmp_path / "run"
    report = run / "report.html"
    shown = run_cli(["report", str(run), "-o", str(report)], timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]

    # The search covers what it should: the run's config, metrics, logs, checkpoint, report and W&B offline run.
    written = {p.relative_to(run).parts[0] for p in run.rglob("*") if p.is_file()}
    assert {"config.toml", "metrics.jsonl", "logs", "checkpoints", "report.html", "wandb"} <= written, written
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), "W&B wrote an offline run"
    needles = [v.encode() for v in SECRETS.values()]
    assert not _files_holding(tmp_path, needles)
    for stream in (train.stdout, train.stderr, shown.stdout, shown.stderr):
        assert not [v for v in SECRETS.values() if v in stream]
