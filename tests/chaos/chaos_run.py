"""`lmforge` that kills itself (SIGKILL) at one chosen point, for the random-kill trials of tests/chaos.

    python tests/chaos/chaos_run.py POINT COUNT lmforge-args...   (also as a torchrun script)

POINT says where the process dies, COUNT which occurrence of that point (1 = the first):

- `micro-batch`: in the middle of a step, as the COUNT-th micro-batch of the run starts its forward;
- `write`: while a checkpoint's shard files are written (the COUNT-th item DCP writes, in the step loop for a
  synchronous save, in the background thread for an async one);
- `before-commit`: a checkpoint fully written but not yet renamed into place (the COUNT-th commit);
- `after-rename`: a checkpoint renamed into place, before `latest` names it (the COUNT-th commit);
- `after-latest`: just after `latest` names the new checkpoint, before older ones are removed (the COUNT-th commit);
- `enospc`: not a kill: the COUNT-th item DCP writes fails with "No space left on device", as on a full disk;
- `none`: no kill from inside (the test may kill the process group from outside at a random time).

`CHAOS_RANK` limits the kill to one rank; the others are then ended by torchrun, as a lost node's are.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint.filesystem as dcp_files

from lmforge.checkpoint import checkpointer
from lmforge.cli import main
from lmforge.train import micro_batches

POINTS = ("micro-batch", "write", "before-commit", "after-rename", "after-latest", "none")


def _mine() -> bool:
    wanted = os.environ.get("CHAOS_RANK")
    return wanted is None or wanted == os.environ.get("RANK", "0")


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_on(count: int, fn: Callable[..., Any], before: bool = True) -> Callable[..., Any]:
    """`fn` that kills the process at its `count`-th call, before running it or (`before=False`) right after."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        hit = calls[0] == count and _mine()
        if hit and before:
            _die()
        result = fn(*args, **kwargs)
        if hit:
            _die()
        return result

    return wrapper


def _fail_on(count: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` whose `count`-th call fails as a write to a full disk does."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == count and _mine():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fn(*args, **kwargs)

    return wrapper


def inject(point: str, count: int) -> None:
    """Patch the one place where the process is to die."""
    if point == "micro-batch":
        micro_batches.token_loss_sum = _kill_on(count, micro_batches.token_loss_sum)
    elif point == "write":
        dcp_files._write_item = _kill_on(count, dcp_files._write_item)  # type: ignore[attr-defined]
    elif point == "before-commit":
        checkpointer.Checkpointer._commit = _kill_on(count, checkpointer.Checkpointer._commit)  # type: ignore[method-assign]
    elif point == "after-rename":
        # `latest` is written by write_atomic right after the rename; other write_atomic calls do not exist.
        checkpointer.write_atomic = _kill_on(count, checkpointer.write_atomic)
    elif point == "after-latest":
        checkpointer.write_atomic = _kill_on(count, checkpointer.write_atomic, before=False)
    elif point == "enospc":
        dcp_files._write_item = _fail_on(count, dcp_files._write_item)  # type: ignore[attr-defined]
    elif point != "none":
        raise SystemExit(f"unknown chaos point {point!r}; one of {POINTS}")


if __name__ == "__main__":
    inject(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
