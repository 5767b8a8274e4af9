"""`lmforge` that kills itself (SIGKILL) at one chosen point, for the random-kill trials of tests/chaos.

    python tests/chaos/chaos_run.py POINT COUNT lmforge-args...   (also as a torchrun script)

POINT says where the process dies, COUNT which occurrence of that point (1 = the first):

- `micro-batch`: in the middle of a step, as the COUNT-th micro-batch of the run starts its forward;
- `write`: while a checkpoint's shard files are written (the COUNT-th item DCP writes into `checkpoints/`, in the
  step loop for a synchronous save, in the background thread for an async one);
- `before-commit`: a checkpoint fully written but not yet renamed into place (the COUNT-th commit);
- `after-rename`: a checkpoint renamed into place, before `latest` names it (the COUNT-th commit);
- `after-latest`: just after `latest` names the new checkpoint, before older ones are removed (the COUNT-th commit);
- `snapshot-write`: while an eval snapshot's files are written (the COUNT-th item DCP writes into `snapshots/`);
- `snapshot-commit`: an eval snapshot fully written but not yet renamed into place (the COUNT-th one);
- `validation`: in the middle of a validation round (the COUNT-th forward that validation runs);
- `enospc`: not a kill: the COUNT-th item DCP writes fails with "No space left on device", as on a full disk;
- `none`: no kill from inside (the test may kill the process group from outside at a random time).

Every point is counted in every run. With `CHAOS_COUNTS=DIR`, each process writes how often each point occurred
to `DIR/rank_<k>.json` when it ends: the trials draw their COUNT from such a counting run of the same config, so a
point that occurs more or less often after a code change is still hit. With `CHAOS_MARK=FILE`, the process
appends `POINT COUNT rank K` to FILE just before it kills itself, the proof that the kill came where it was meant
to. `CHAOS_RANK` limits the kill to one rank; the others are then ended by torchrun, as a lost node's are.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint.filesystem as dcp_files

from lmforge.checkpoint import checkpointer
from lmforge.checkpoint.layout import CHECKPOINTS, SNAPSHOTS
from lmforge.cli import main
from lmforge.eval import validation
from lmforge.model.llama import CausalLM
from lmforge.train import micro_batches

KILLS = ("micro-batch", "write", "before-commit", "after-rename", "after-latest", "snapshot-write",
         "snapshot-commit", "validation")  # fmt: skip
"""The points where a process kills itself."""
POINTS = (*KILLS, "none")
"""Every point a trial may draw."""

COUNTS = dict.fromkeys(KILLS, 0)
"""How often each point occurred in this process so far."""
TARGET: tuple[str, int] | None = None
"""The (point, occurrence) this process dies at; None: it never kills itself."""
IN_VALIDATION = [False]
"""Whether the process is inside a validation round."""


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _mine() -> bool:
    wanted = os.environ.get("CHAOS_RANK")
    return wanted is None or wanted == _rank()


def _die(point: str) -> None:
    mark = os.environ.get("CHAOS_MARK")
    if mark:
        with open(mark, "a", encoding="utf-8") as f:
            f.write(f"{point} {COUNTS[point]} rank {_rank()}\n")
            f.flush()
            os.fsync(f.fileno())
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _reached(point: str) -> bool:
    """Count one occurrence of `point`; whether this process dies at it."""
    COUNTS[point] += 1
    return (point, COUNTS[point]) == TARGET and _mine()


def _hook(point: str, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a, **k: True,
          before: bool = True) -> Callable[..., Any]:  # fmt: skip
    """`fn` that counts `point` at each call for which `when` holds, and kills the process at the chosen one,
    before running `fn` or (`before=False`) right after."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hit = when(*args, **kwargs) and _reached(point)
        if hit and before:
            _die(point)
        result = fn(*args, **kwargs)
        if hit:
            _die(point)
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


def _into(folder: str) -> Callable[..., bool]:
    """Whether a DCP item is written into a save under `<run>/<folder>/` (its stream is the shard file)."""
    return lambda transforms, stream, *a, **k: Path(getattr(stream, "name", "")).parent.parent.name == folder


def _latest_of(folder: str) -> Callable[..., bool]:
    """Whether `write_atomic(path, text)` replaces the `latest` file of `<run>/<folder>/`."""
    return lambda path, *a, **k: Path(path).parent.name == folder


def _validating(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        IN_VALIDATION[0] = True
        try:
            return evaluate(*args, **kwargs)
        finally:
            IN_VALIDATION[0] = False

    return wrapper


def _write_counts() -> None:
    folder = os.environ.get("CHAOS_COUNTS")
    if folder:
        Path(folder, f"rank_{_rank()}.json").write_text(json.dumps(COUNTS))


def inject(point: str, count: int) -> None:
    """Count every point, and kill the process at the `count`-th occurrence of `point`."""
    global TARGET
    if point not in (*POINTS, "enospc"):
        raise SystemExit(f"unknown chaos point {point!r}; one of {POINTS}")
    TARGET = (point, count) if point in KILLS else None
    Commit = checkpointer.Checkpointer
    micro_batches.token_loss_sum = _hook("micro-batch", micro_batches.token_loss_sum)
    write = dcp_files._write_item  # type: ignore[attr-defined]
    write = _hook("write", write, _into(CHECKPOINTS))
    write = _hook("snapshot-write", write, _into(SNAPSHOTS))
    if point == "enospc":
        write = _fail_on(count, write)
    dcp_files._write_item = write  # type: ignore[attr-defined]
    commit = _hook("before-commit", Commit._commit, lambda self, step: not self.model_only)
    Commit._commit = _hook("snapshot-commit", commit, lambda self, step: self.model_only)  # type: ignore[method-assign]
    # `latest` is written by write_atomic right after the rename; the checkpointer makes no other such call.
    latest = _hook("after-rename", checkpointer.write_atomic, _latest_of(CHECKPOINTS))
    checkpointer.write_atomic = _hook("after-latest", latest, _latest_of(CHECKPOINTS), before=False)
    validation.Validator.evaluate = _validating(validation.Validator.evaluate)  # type: ignore[method-assign]
    CausalLM.forward = _hook("validation", CausalLM.forward, lambda *a, **k: IN_VALIDATION[0])  # type: ignore[method-assign]
    atexit.register(_write_counts)


if __name__ == "__main__":
    inject(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
