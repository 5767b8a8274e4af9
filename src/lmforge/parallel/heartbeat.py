"""Heartbeats in the process group's store, to name the ranks that are gone when a collective fails.

A rank that dies (killed, out of memory, its node lost) or hangs leaves the others in their next collective until
it fails (a closed connection: at once) or times out (`parallel.timeout_s`), with an error that names neither the
rank nor what happened to it. Every rank therefore counts up a key of its own in the store (the rendezvous store
that torchrun or the first rank hosts) from a daemon thread. When a collective fails, `silent_ranks` reads every
count twice, a few beats apart: a rank whose count stood still has stopped. Counting, not timestamps, so that the
nodes' clocks need not agree.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

_PREFIX = "lmforge/heartbeat/"


class Heartbeat:
    """This rank's heartbeat thread and the check of the others' beats."""

    def __init__(self, rank: int, world_size: int, interval_s: float) -> None:
        """Start beating every `interval_s` seconds (the process group must exist)."""
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._count = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, name="lmforge-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        self.store.set(f"{_PREFIX}{self.rank}", str(self._count))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store's host is gone: the rank that notices a failed collective reports it
                return

    def _counts(self) -> dict[int, int | None]:
        keys = [f"{_PREFIX}{r}" for r in range(self.world_size)]
        return {r: int(self.store.get(k)) if self.store.check([k]) else None for r, k in enumerate(keys)}

    def silent_ranks(self) -> list[int] | None:
        """The ranks whose beat stood still over three beats, or None when the store itself cannot be reached
        (its host, torchrun's agent or the first rank's process, is gone too)."""
        try:
            self.store.set_timeout(datetime.timedelta(seconds=max(5.0, 3 * self.interval_s)))
            before = self._counts()
            time.sleep(3 * self.interval_s)
            after = self._counts()
        except Exception:
            return None
        return [r for r in range(self.world_size) if r != self.rank and (after[r] is None or after[r] == before[r])]

    def stop(self) -> None:
        """Stop beating (at the end of a run)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)


def describe_lost(rank: int, silent: list[int] | None, error: BaseException) -> str:
    """One line for a collective that failed on `rank`: which ranks went silent, and the error's first line."""
    cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if silent is None:
        who = "the process group's store cannot be reached either, so its host (the first rank or torchrun) is gone"
    else:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering"
    return (
        f"rank {rank} lost the rest of the run: {who} (the process died, hung or lost its node); the collective "
        f"failed with {cause}"
    )
