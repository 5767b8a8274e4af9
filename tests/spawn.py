"""Run a function on two spawned processes (one per rank), end them within a time bound, read their results."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], out: Path, timeout: float, n: int = 2) -> list[Any]:
    """Start `worker(rank, *args)` on `n` spawned processes, kill any still alive after `timeout` seconds, check
    that all exited 0, and return what each wrote to `out/rank<r>.json`."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, *args)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * n
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_as_rank(rank: int, port: int, world_size: int = 2) -> None:
    """Inside a spawned worker: the environment torch.distributed reads to make this process `rank` of
    `world_size` on the loopback interface, and one compute thread (results then do not depend on the core count)."""
    import torch

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update(env, WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
