"""`lmforge` with one injected fault, for the preemption and crash-safety tests.

    python tests/integration/faulty_run.py FAULT STEP lmforge-args...   (also as a torchrun script)

FAULT is `sigterm` (the process sends itself SIGTERM while it runs step STEP), `sigterm-twice` (the same, then a
second SIGTERM as the checkpoint that the first one asked for starts), `hang-in-commit` (the checkpoint of step
STEP is fully written but the process stops before committing it, prints HANG and waits to be killed),
`record-full` (from step STEP on, writing metrics.jsonl fails as on a full disk), `log-full` (from step STEP on,
writing the rank's log file fails so) or `raise` (step STEP raises an error, as a bug would). `FAULT_RANK` limits
the fault to one rank.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Any

from lmforge.checkpoint import checkpointer
from lmforge.cli import main
from lmforge.monitor.jsonl import JsonlMonitor
from lmforge.train import trainer


def _mine() -> bool:
    wanted = os.environ.get("FAULT_RANK")
    return wanted is None or wanted == os.environ.get("RANK", "0")


class FullFile:
    """A file whose writes fail as on a full disk; everything else goes to the real one."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def inject(fault: str, step: int) -> None:
    """Patch the trainer or the checkpointer so that `fault` happens at `step`."""
    train_step = trainer.Trainer.train_step
    save = checkpointer.Checkpointer.save
    commit = checkpointer.Checkpointer._commit

    def faulty_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.step + 1 == step and _mine():
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self, *args, **kwargs)

    def faulty_save(self, at, *args, **kwargs):  # type: ignore[no-untyped-def]
        if at >= step and _mine():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler exits the process before this ends
        return save(self, at, *args, **kwargs)

    def faulty_commit(self, at):  # type: ignore[no-untyped-def]
        if at == step:
            print("HANG", flush=True)
            time.sleep(600)
        return commit(self, at)

    log_metrics = JsonlMonitor.log

    def full_metrics(self, at, metrics):  # type: ignore[no-untyped-def]
        if at >= step and _mine() and not isinstance(self._file, FullFile):
            self._file = FullFile(self._file)
        return log_metrics(self, at, metrics)

    def full_log(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.step + 1 == step and _mine():
            for handler in self.log.handlers:
                handler.stream = FullFile(handler.stream)
        return train_step(self, *args, **kwargs)

    def raising_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.step + 1 == step and _mine():
            raise RuntimeError(f"injected fault at step {step}")
        return train_step(self, *args, **kwargs)

    if fault == "raise":
        trainer.Trainer.train_step = raising_step  # type: ignore[method-assign]
    if fault == "record-full":
        JsonlMonitor.log = full_metrics  # type: ignore[method-assign]
    if fault == "log-full":
        trainer.Trainer.train_step = full_log  # type: ignore[method-assign]
    if fault in ("sigterm", "sigterm-twice"):
        trainer.Trainer.train_step = faulty_step  # type: ignore[method-assign]
    if fault == "sigterm-twice":
        checkpointer.Checkpointer.save = faulty_save  # type: ignore[method-assign]
    if fault == "hang-in-commit":
        checkpointer.Checkpointer._commit = faulty_commit  # type: ignore[method-assign]


if __name__ == "__main__":
    inject(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
