"""Host memory of CPU runs: keep what the allocator frees inside the process instead of handing it back.

glibc serves large allocations (above a threshold that grows with use, up to 32 MiB) with fresh memory maps and
gives freed memory at the top of its heap back to the kernel. A training step allocates and frees the same
activation-sized buffers every step, so each step touches new pages again: the kernel faults in and zeroes every
4 KiB of them (measured on the d256 benchmark model: about 34,000 page faults per training step, and about 600
with this setting, which made the step 10-25% faster on 2 cores). Setting the
mmap threshold above any buffer and the trim threshold to its maximum keeps freed memory for the next step; the
resident set then stays at its peak, which it reaches every step anyway. Only the CPU device needs this: on CUDA,
tensors live in PyTorch's caching allocator.

The environment decides first: where it sets either of glibc's thresholds itself (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`) or `LMFORGE_KEEP_FREED_MEMORY=0`, lmforge changes nothing, so a user's own malloc settings
(or glibc's defaults, for a comparison) hold. `ENV_SETTING` is the same setting for another program's environment:
benchmarks give it to every side they compare lmforge with.

It does not take in every process: measured on this machine (glibc 2.36), a freed 48 MiB buffer is reused in 4 of
10 fresh processes and mapped afresh every time in the other 6, depending on where the kernel placed the process's
heap (tests/unit/test_host_memory.py). The cause of the difference is not established yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
"""glibc's `mallopt` parameter: free memory at the top of the heap above this many bytes goes back to the kernel."""
M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter: allocations of at least this many bytes get a memory map of their own."""
MMAP_THRESHOLD = 1 << 30
"""Bytes: no activation of a CPU run is this large, so every one comes from the heap and is reused."""
TRIM_THRESHOLD = 2**31 - 1
"""Bytes: the largest value `mallopt` takes (a C int); the heap is not trimmed below it."""
ENV_SETTING = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
"""The same setting as environment variables, which glibc reads when a program starts."""
SWITCH = "LMFORGE_KEEP_FREED_MEMORY"
"""Environment variable: `0` leaves glibc's settings as they are."""


def settings_from_environment() -> bool:
    """Whether the environment decides the allocator's settings (see the module docstring)."""
    return os.environ.get(SWITCH) == "0" or any(name in os.environ for name in ENV_SETTING)


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory (see the module docstring); True when it accepted both settings, False where
    the environment decides (`settings_from_environment`) and on other platforms or C libraries, where nothing
    changes."""
    if not sys.platform.startswith("linux") or settings_from_environment():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
