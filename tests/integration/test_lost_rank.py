"""One of two processes dies, hangs or fails: the other exits within a bounded time, naming the lost rank.

The ranks are started by hand (as a launcher without torchrun's agent would, e.g. one task per GPU), so nothing
but lmforge itself ends the survivor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.runner import env_one_thread, write_config
from tests.spawn import free_port

pytestmark = pytest.mark.slow

CHAOS_RUN = Path(__file__).parents[1] / "chaos" / "chaos_run.py"
FAULTY_RUN = Path(__file__).with_name("faulty_run.py")
TIMEOUT_S = 5


def _start(
    rank: int, port: int, cfg: Path, point: str, count: int, script: Path = CHAOS_RUN, timeout_s: int = TIMEOUT_S
) -> subprocess.Popen[str]:
    env = {**env_one_thread(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "CHAOS_RANK": "1", "FAULT_RANK": "1"}  # fmt: skip
    cmd = [sys.executable, str(script), point, str(count), "train", "@", str(cfg),
           "--parallel.timeout-s", str(timeout_s)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _end(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_a_killed_rank_is_named_by_the_survivor(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=40)
    port = free_port()
    # Rank 1 kills itself as its 10th micro-batch starts (its third step).
    survivor, victim = _start(0, port, cfg, "micro-batch", 10), _start(1, port, cfg, "micro-batch", 10)
    try:
        victim.wait(timeout=120)
        assert victim.returncode == -signal.SIGKILL
        t0 = time.perf_counter()
        _, err = survivor.communicate(timeout=60)
        assert time.perf_counter() - t0 < 30
    finally:
        _end(survivor, victim)
    assert survivor.returncode == 1, err[-3000:]
    assert "lmforge train: error: rank 0 lost the rest of the run: rank 1 stopped answering" in err, err[-3000:]


def test_a_rank_that_fails_leaves_at_once_and_its_peer_follows(tmp_path: Path) -> None:
    # Rank 1 raises as its step 3 starts, while rank 0 waits for it in the step's reduction. With a 10-minute
    # collective timeout, rank 0 ends only because rank 1 left without an orderly exit's barrier.
    cfg = write_config(tmp_path, "run", max_steps=40)
    port = free_port()
    peer, failing = (_start(r, port, cfg, "raise", 3, FAULTY_RUN, timeout_s=600) for r in (0, 1))
    try:
        t0 = time.perf_counter()
        _, failed = failing.communicate(timeout=120)
        _, err = peer.communicate(timeout=60)
        waited = time.perf_counter() - t0
    finally:
        _end(peer, failing)
    assert failing.returncode == 1 and "RuntimeError: injected fault at step 3" in failed, failed[-3000:]
    assert peer.returncode == 1, err[-3000:]
    assert "rank 0 lost the rest of the run: rank 1 stopped answering" in err, err[-3000:]
    assert waited < 90, waited


def test_a_hung_rank_is_given_up_after_the_timeout(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=2000)
    port = free_port()
    survivor, hung = _start(0, port, cfg, "none", 0), _start(1, port, cfg, "none", 0)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert survivor.poll() is None and hung.poll() is None, "a rank ended before the test hung one"
            time.sleep(0.2)
        os.kill(hung.pid, signal.SIGSTOP)  # alive, its connections open, answering nothing
        t0 = time.perf_counter()
        _, err = survivor.communicate(timeout=120)
        waited = time.perf_counter() - t0
    finally:
        _end(survivor, hung)
    assert survivor.returncode == 1, err[-3000:]
    assert "rank 0 lost the rest of the run: rank 1 stopped answering" in err, err[-3000:]
    # The collective's timeout, then three heartbeats of checking, with room for a slow machine.
    assert TIMEOUT_S <= waited < TIMEOUT_S + 20, waited
