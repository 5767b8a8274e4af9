"""SIGTERM / SIGINT during training: checkpoint at the next step boundary and exit cleanly; a second one exits now.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some time before they kill a job. The handler only
sets a flag; the step loop reads it through the step's existing all-reduce, so every rank stops after the same
step even when only some of them received the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installed while the loop runs: the first signal asks for a stop, the second exits the process at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether this process has received a stop signal."""
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            # The last committed checkpoint stays as it is; an unfinished one stays under its temporary name.
            sys.stderr.write(f"\nlmforge: second {name}: exiting now without a checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signal_name = name
        sys.stderr.write(f"\nlmforge: {name} received: saving a checkpoint after this step, then stopping "
                         "(send it again to exit at once)\n")  # fmt: skip
        sys.stderr.flush()

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (only possible from the main thread; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
