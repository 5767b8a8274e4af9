"""`[parallel]`: how the ranks of a run work together."""

from __future__ import annotations

from pydantic import Field

from lmforge.config.base import Section


class ParallelConfig(Section):
    """The process group of a run on several processes."""

    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a rank waits in one collective (an all-reduce, a checkpoint's agreement) for the others before it
    gives up and exits, naming the ranks that stopped answering. Raise it when one rank may legitimately work alone
    for longer (a very slow first compilation on some ranks only)."""
