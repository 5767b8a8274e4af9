"""What torchrun tells each process through its environment, read before the process group exists (and without
importing torch, so a config can be checked for the run's world size first)."""

from __future__ import annotations

import os


def env_world_size() -> int:
    """The world size torchrun announces, 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))
