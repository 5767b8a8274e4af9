"""The W&B monitor, offline: what it logs (read back from the run's transaction log), resume, off switches."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from lmforge.config.wandb import WandbConfig
from lmforge.monitor import JsonlMonitor, Monitors, RecordError, read_metrics
from lmforge.monitor.wandb import RUN_ID_FILE, WandbMonitor, wandb_key
from tests.conftest import require

CONFIG = {"max_steps": 10, "output_dir": "runs/x", "optim": {"type": "muon", "lr": 0.02}, "wandb": {"tags": ["t"]}}


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Isolate W&B from the user's settings and keep its start-up short: no git, no system stats, no code.

    Module-scoped because W&B reads its environment once per process (in `wandb.setup`); torn down at the end so
    no W&B service outlives the module.
    """
    wandb = require("wandb")
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("WANDB_")]:
            mp.delenv(name)
        env = {
            "WANDB_SILENT": "true",
            "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true",
            "WANDB__DISABLE_STATS": "true",
            "WANDB__DISABLE_MACHINE_INFO": "true",
            "WANDB__DISABLE_META": "true",
            "WANDB_DIR": str(home / "dir"),
            "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        }
        for name, value in env.items():
            mp.setenv(name, value)
        wandb.teardown()  # a W&B set up earlier in this process would keep its old settings
        yield
        wandb.teardown()


def offline(**fields: Any) -> WandbConfig:
    return WandbConfig(project="lmforge-test", mode="offline", **fields)


def read_log(path: Path) -> list[Any]:
    """The complete records of a `.wandb` transaction log: W&B's 7-byte file header, then a LevelDB-style log
    (32 KiB blocks of CRC-checked chunks) of `wandb_internal_pb2.Record` messages. wandb 0.31 has no Python
    reader of its own (wandb-core writes the file), and offline runs write no wandb-summary.json."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32 * 1024, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, parts, pos = [], [], header
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if pos + header + length > len(data):  # still being written
            break
        chunk = data[pos + header : pos + header + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad chunk at byte {pos} of {path}"
        pos += header + length
        parts.append(chunk)
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def read_finished_log(path: Path, timeout: float = 10.0) -> list[Any]:
    """The records of a finished run's log. `Run.finish()` only asks wandb-core to close the run, which then
    writes out the log a few milliseconds later (at the latest when the process exits), so wait for the exit
    record that ends it."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_log(path)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path} was not completed within {timeout} s"
        time.sleep(0.01)


def item_key(item: Any) -> str:
    # wandb-core writes flat keys such as "loss/mean" as a one-element nested_key.
    return item.key or ".".join(item.nested_key)


class LoggedRun:
    """What one offline W&B run holds: its run record, history rows by step, and the summary updates."""

    def __init__(self, run_file: Path) -> None:
        self.run: Any = None
        self.history: dict[int, dict[str, Any]] = {}
        self.summary: dict[str, Any] = {}
        for record in read_finished_log(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
            elif kind == "history":
                row = {item_key(i): json.loads(i.value_json) for i in record.history.item}
                self.history.setdefault(record.history.step.num, {}).update(row)
            elif kind == "summary":
                self.summary.update({item_key(i): json.loads(i.value_json) for i in record.summary.update})

    @property
    def config(self) -> dict[str, Any]:
        return {u.key: json.loads(u.value_json) for u in self.run.config.update}


def logged_runs(run_dir: Path, run_id: str) -> list[LoggedRun]:
    """The offline runs written under `<run_dir>/wandb/` for W&B run `run_id` (one per start), oldest first."""
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    return [LoggedRun(f) for f in files]


def stored_id(run_dir: Path) -> str:
    return (run_dir / RUN_ID_FILE).read_text().strip()


def test_config_section() -> None:
    assert not WandbConfig().enabled
    assert not WandbConfig(project="p", mode="disabled").enabled
    assert WandbConfig(project="p").enabled
    assert WandbConfig().mode == "online"
    with pytest.raises(ValidationError):
        WandbConfig(project="p", mode="shared")
    with pytest.raises(ValidationError):
        WandbConfig(projekt="p")
    assert all(f.description for f in WandbConfig.model_fields.values())


def test_wandb_key_puts_moe_metrics_in_one_section() -> None:
    assert wandb_key("max_vio/mean") == "moe/max_vio/mean"
    assert wandb_key("expert_load/layer_3/cv") == "moe/expert_load/layer_3/cv"
    assert wandb_key("moe/aux_loss") == "moe/aux_loss"
    for key in ("loss/mean", "optim/grad_norm/hidden", "val/heldout/bpb@512", "perf/mfu", "max_vio_total"):
        assert wandb_key(key) == key


def test_off_without_wandb_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    for cfg in (WandbConfig(), WandbConfig(project="p", mode="disabled")):
        monitor = WandbMonitor(cfg, tmp_path, CONFIG)
        monitor.log(1, {"loss/mean": 1.0})
        monitor.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ImportError, match=r"pip install 'lmforge\[wandb\]'"):
        WandbMonitor(offline(), tmp_path, CONFIG)


@pytest.mark.usefixtures("wandb_env")
def test_disabled_writes_nothing(tmp_path: Path) -> None:
    monitor = WandbMonitor(WandbConfig(project="p", mode="disabled"), tmp_path / "run", CONFIG)
    monitor.log(1, {"loss/mean": 1.0})
    monitor.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("wandb_env")
def test_offline_run_holds_metrics_config_and_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "my_run"
    monitor = WandbMonitor(offline(group="g", tags=["a", "b"]), run_dir, CONFIG)
    monitor.log(0, {"params/total": 1.5e6, "params/embedding": 2.5e5})
    monitor.log(1, {"loss/mean": 2.5, "optim/lr": 1e-3, "optim/grad_norm/hidden": 0.5, "perf/mfu": math.nan})
    monitor.log(2, {"loss/mean": 2.25, "optim/lr": math.inf, "max_vio/mean": 0.2, "expert_load/layer_3/cv": 0.1})
    monitor.log(2, {"val/loss": 2.4, "val/heldout/bpb@512": 1.1})  # a second call for the same step joins its row
    monitor.close()

    run_id = stored_id(run_dir)
    [run] = logged_runs(run_dir, run_id)
    assert run.run.run_id == run_id
    assert (run.run.project, run.run.run_group, run.run.display_name) == ("lmforge-test", "g", "my_run")
    assert list(run.run.tags) == ["a", "b"]
    assert run.config["optim"] == {"type": "muon", "lr": 0.02}
    assert run.config["max_steps"] == 10

    assert sorted(run.history) == [1, 2]  # step 0 held only params/*, which go to the summary
    assert {"loss/mean": 2.5, "optim/lr": 1e-3, "optim/grad_norm/hidden": 0.5}.items() <= run.history[1].items()
    assert "perf/mfu" not in run.history[1]  # NaN and inf are left out
    assert "optim/lr" not in run.history[2]
    expected = {
        "loss/mean": 2.25,
        "moe/max_vio/mean": 0.2,
        "moe/expert_load/layer_3/cv": 0.1,
        "val/loss": 2.4,
        "val/heldout/bpb@512": 1.1,
    }
    assert expected.items() <= run.history[2].items()
    assert not any(
        key.startswith(("max_vio/", "expert_load/", "params/")) for row in run.history.values() for key in row
    )
    assert {"params/total": 1.5e6, "params/embedding": 2.5e5}.items() <= run.summary.items()
    assert run.summary["loss/mean"] == 2.25


@pytest.mark.usefixtures("wandb_env")
def test_resumed_run_continues_the_wandb_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = WandbMonitor(offline(), run_dir, CONFIG)
    first.log(1, {"loss/mean": 3.0})
    first.close()
    run_id = stored_id(run_dir)

    # Another W&B dir: W&B names an offline run's folder by its start second and id, which would collide here.
    resumed_cfg = offline(dir=str(tmp_path / "attempt_2"))
    resumed = WandbMonitor(resumed_cfg, run_dir, {**CONFIG, "max_steps": 20}, start_step=5)
    assert resumed.run.id == run_id
    resumed.log(6, {"loss/mean": 2.0})
    resumed.close()
    runs = logged_runs(run_dir, run_id) + logged_runs(tmp_path / "attempt_2", run_id)
    assert [sorted(r.history) for r in runs] == [[1], [6]]
    assert runs[1].history[6]["loss/mean"] == 2.0
    assert runs[1].config["max_steps"] == 20  # a resume may change the config

    # Starting over at step 0 (e.g. --overwrite) must not append to the old run, whose steps W&B would keep.
    fresh = WandbMonitor(offline(), run_dir, CONFIG)
    fresh.close()
    assert stored_id(run_dir) != run_id


@pytest.mark.usefixtures("wandb_env")
def test_dir_setting(tmp_path: Path) -> None:
    monitor = WandbMonitor(offline(dir=str(tmp_path / "elsewhere")), tmp_path / "run", CONFIG)
    monitor.close()
    run_id = stored_id(tmp_path / "run")
    assert len(logged_runs(tmp_path / "elsewhere", run_id)) == 1
    assert not (tmp_path / "run" / "wandb").exists()


class Broken:
    """A monitor whose every log fails."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise RuntimeError("disk full")

    def close(self) -> None:
        pass


def warned(caught: pytest.WarningsRecorder) -> list[str]:
    # Only the fan-out's warnings: W&B may warn about other things (deprecations) at the same time.
    return [str(w.message) for w in caught if "training goes on" in str(w.message)]


@pytest.mark.usefixtures("wandb_env")
def test_a_failing_optional_monitor_is_counted_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    wandb_monitor = WandbMonitor(offline(), run_dir, CONFIG)
    jsonl = JsonlMonitor(run_dir / "metrics.jsonl")
    monitors = Monitors([Broken(), wandb_monitor, jsonl])
    with pytest.warns(UserWarning, match="broken failed in log") as caught:
        monitors.log(1, {"loss/mean": 3.0})
        monitors.log(2, {"loss/mean": 2.0})
    assert len(warned(caught)) == 1  # warned once, counted every time

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("W&B unreachable")

    monkeypatch.setattr(wandb_monitor.run, "log", unreachable)  # W&B itself failing mid-run
    with pytest.warns(UserWarning, match="wandb failed in log") as caught:
        monitors.log(3, {"loss/mean": 1.0})
        monitors.log(4, {"loss/mean": 0.5})
    assert len(warned(caught)) == 1
    monkeypatch.undo()  # W&B is back: the monitor was kept, so it logs again
    monitors.log(5, {"loss/mean": 0.25})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitors.close()
    assert len(monitors.monitors) == 3  # none was dropped

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # Each logged step carries the failures so far (of the steps before it).
    assert [r.get("monitor/failures/broken") for r in records] == [None, 1.0, 2.0, 3.0, 4.0]
    assert [r.get("monitor/failures/wandb") for r in records] == [None, None, None, 1.0, 2.0]
    [logged] = logged_runs(run_dir, stored_id(run_dir))
    assert sorted(logged.history) == [1, 2, 5]


def test_a_failing_record_stops_the_fan_out(tmp_path: Path) -> None:
    class Required(Broken):
        required = True

    with pytest.raises(RecordError, match=r"monitor required failed in log: RuntimeError: disk full"):
        Monitors([Required()]).log(1, {"loss/mean": 3.0})
