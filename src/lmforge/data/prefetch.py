"""Build the next steps' micro-batches in a background thread while the current step trains."""

from __future__ import annotations

import queue
import threading
from typing import Any

from lmforge.data.base import StepData
from lmforge.data.batch import MicroBatch

_DONE = object()


class Prefetcher:
    """Wraps a StepData: `depth` steps are prepared ahead; the state is that of the last step handed out."""

    def __init__(self, source: StepData, depth: int = 2, pin_memory: bool = False) -> None:
        self.source = source
        self.depth = depth
        self.pin_memory = pin_memory
        self._state = source.state_dict()
        self._epoch = source.epoch
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batches = self.source.next_step()
                if self.pin_memory:
                    batches = [mb.pin_memory() for mb in batches]
                item = (batches, self.source.state_dict(), self.source.epoch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the trainer thread, which raises it
            self._queue.put((_DONE, e, None))

    def next_step(self) -> list[MicroBatch]:
        """The next step's micro-batches (waits if the worker is behind)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="lmforge-data", daemon=True)
            self._thread.start()
        batches, state, epoch = self._queue.get()
        if batches is _DONE:
            raise state
        self._state, self._epoch = state, epoch
        return batches

    def state_dict(self) -> dict[str, Any]:
        """Position after the last step handed out (not after the ones prepared ahead)."""
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only before the first next_step."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must come before the first next_step")
        self.source.load_state_dict(state)
        self._state = self.source.state_dict()

    @property
    def epoch(self) -> float:
        """Epoch progress after the last step handed out."""
        return self._epoch

    def close(self) -> None:
        """Stop the worker thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
