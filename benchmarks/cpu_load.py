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
