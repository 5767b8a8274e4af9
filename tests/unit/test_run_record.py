"""The run record never goes silent: a failed write of metrics.jsonl leaves no torn line and raises `RecordError`;
a failed write of a rank log is kept, not printed at every line; and a trainer whose record fails stops at the next
step, on every rank, without committing another checkpoint."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmforge.checkpoint.layout import CHECKPOINTS, list_checkpoints, read_latest
from lmforge.config import TrainConfig
from lmforge.monitor import JsonlMonitor, RecordError, read_metrics
from lmforge.parallel.process_group import DistContext, init_distributed
from lmforge.train.logs import close_logger, log_failure, rank_logger
from lmforge.train.trainer import Trainer
from tests.conftest import tiny_llama


class ShortDisk:
    """A file that takes `writes` more writes in full, then `cut` bytes of the next one, then fails as a full disk
    does."""

    def __init__(self, real: Any, writes: int, cut: int = 0) -> None:
        self.real, self.writes, self.cut = real, writes, cut

    def write(self, data: Any) -> int:
        if self.writes > 0:
            self.writes -= 1
            return int(self.real.write(data))
        if self.cut > 0:
            taken, self.cut = int(self.real.write(data[: self.cut])), 0
            return taken
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        if self.writes <= 0 and self.cut <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_cut_off_write_leaves_whole_records_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    monitor = JsonlMonitor(path)
    monitor.log(1, {"loss/mean": 2.0})
    monitor._file = ShortDisk(monitor._file, writes=0, cut=10)  # the next line is cut after 10 bytes
    with pytest.raises(RecordError, match=rf"writing {path} failed at step 2: OSError: \[Errno 28\] No space left"):
        monitor.log(2, {"loss/mean": 1.5})
    monitor.close()
    assert path.read_text() == '{"step": 1, "loss/mean": 2.0}\n'
    assert [r["step"] for r in read_metrics(path)] == [1]


def test_reading_leaves_out_a_torn_last_line_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)


def test_a_failed_log_write_is_kept_not_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = rank_logger(tmp_path, 3)
    log.info("first line")
    assert log_failure(log) is None
    handler = log.handlers[0]
    handler.stream = ShortDisk(handler.stream, writes=0)  # type: ignore[attr-defined]
    for i in range(5):
        log.info("line %d", i)
    failure = log_failure(log)
    assert failure is not None and str(tmp_path / "logs" / "rank_3.log") in failure and "Errno 28" in failure
    close_logger(log)  # no traceback either when the buffered lines cannot be flushed
    assert "Logging error" not in capsys.readouterr().err
    assert "first line" in (tmp_path / "logs" / "rank_3.log").read_text()
    logging.getLogger("lmforge.rank3").handlers.clear()


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def _config(tmp_path: Path) -> TrainConfig:
    return TrainConfig.model_validate({
        "max_steps": 6,
        "output_dir": str(tmp_path / "run"),
        "model": {"arch": tiny_llama().model_dump()},
        "data": {"type": "fake", "seq_len": 32, "batch_tokens": 128, "micro_batch_tokens": 64, "vocab_size": 100},
        "optim": {"lr": 1e-3},
        "ckpt": {"interval": 2},
        "log": {"interval": 1},
    })  # fmt: skip


def test_a_trainer_whose_record_fails_stops_at_the_next_step(tmp_path: Path, ctx: DistContext) -> None:
    trainer = Trainer(_config(tmp_path), ctx, console=False)
    jsonl = next(m for m in trainer.monitors.monitors if isinstance(m, JsonlMonitor))
    jsonl._file = ShortDisk(jsonl._file, writes=3, cut=7)  # steps 0, 1 and 2 are recorded; step 3's line is cut
    run = tmp_path / "run"
    with pytest.raises(RecordError) as caught:
        trainer.train()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
    message = str(caught.value)
    assert f"writing {run / 'metrics.jsonl'} failed at step 3: OSError: [Errno 28]" in message
    assert "training stopped after step 3" in message, message
    assert trainer.step == 3  # stopped in step 4, before its update
    # Step 2's checkpoint was committed (its line was written), none after it: a resume replays step 3 and logs it.
    assert read_latest(run / CHECKPOINTS) == 2 and list_checkpoints(run / CHECKPOINTS) == [2]
    assert "continue from step_2 with --resume.step latest" in message
