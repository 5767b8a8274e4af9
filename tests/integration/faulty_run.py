"""`lmforge` with one injected fault, for the preemption and crash-safety tests.

    python tests/integration/faulty_run.py FAULT STEP lmforge-args...   (also as a torchrun script)

FAULT is `sigterm` (the process sends itself SIGTERM while it runs step STEP), `sigterm-twice` (the same, then a
second SIGTERM as the checkpoint that the first one asked for starts) or `hang-in-commit` (the checkpoint of step
STEP is fully written but the process stops before committing it, prints HANG and waits to be killed).
`FAULT_RANK` limits the fault to one rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from lmforge.checkpoint import checkpointer
from lmforge.cli import main
from lmforge.train import trainer


def _mine() -> bool:
    wanted = os.environ.get("FAULT_RANK")
    return wanted is None or wanted == os.environ.get("RANK", "0")


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

    if fault in ("sigterm", "sigterm-twice"):
        trainer.Trainer.train_step = faulty_step  # type: ignore[method-assign]
    if fault == "sigterm-twice":
        checkpointer.Checkpointer.save = faulty_save  # type: ignore[method-assign]
    if fault == "hang-in-commit":
        checkpointer.Checkpointer._commit = faulty_commit  # type: ignore[method-assign]


if __name__ == "__main__":
    inject(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
