"""CPU-load bookkeeping shared by the benchmark scripts: foreign load spoils timings on a 2-core machine."""

from __future__ import annotations

import os
import resource
import time


def cpu_busy_s() -> float:
    """Seconds of CPU time spent by the whole machine (all processes, all cores) since boot; 0 off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process, all its threads included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wait_until_quiet(limit_s: float, threshold: float = 0.25) -> float:
    """Wait up to `limit_s` for other processes to leave the CPUs idle; returns the busy cores last sampled.

    The caller is idle while it waits, so all the CPU time the machine spends is foreign load.
    """
    deadline = time.monotonic() + limit_s
    while True:
        b0, t0 = cpu_busy_s(), time.monotonic()
        time.sleep(1.0)
        busy = (cpu_busy_s() - b0) / (time.monotonic() - t0)
        if busy < threshold or time.monotonic() >= deadline:
            return busy


def settle(limit_s: float) -> float | None:
    """`wait_until_quiet(limit_s)` when `limit_s` > 0 (returns the busy cores it saw); None, at once, when it is 0.

    Smoke runs pass 0: they check that a script runs, and a second of sampling per run would be most of their time.
    """
    return wait_until_quiet(limit_s) if limit_s > 0 else None


class ForeignLoad:
    """The CPU time other processes spend from `start()` on: the machine's busy time minus this process's own."""

    def __init__(self) -> None:
        """Start counting now."""
        self.start()

    def start(self) -> None:
        """Count from now on."""
        self._busy0, self._own0 = cpu_busy_s(), own_cpu_s()

    def cpu_s(self) -> float:
        """Foreign CPU seconds since `start()` (can come out slightly negative: the two clocks tick separately)."""
        return cpu_busy_s() - self._busy0 - (own_cpu_s() - self._own0)

    def cores(self, wall_s: float) -> float:
        """Mean number of cores other processes kept busy over `wall_s` seconds since `start()`, at least 0."""
        return max(self.cpu_s() / wall_s, 0.0)
