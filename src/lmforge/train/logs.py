"""Per-rank log files: `<output_dir>/logs/rank_<k>.log`, so a problem on any rank leaves a trace on disk.

Rank 0 also shows its lines on the console (the rich monitor); the files keep every rank's startup facts, logged
steps, checkpoints, stop requests and the traceback of an exception that ends the run.

A log file is part of the run's record. A write that fails (a full disk) does not print Python's logging
traceback at every later line: the handler keeps the first failure (`log_failure`), and the trainer stops the
run at its next step, as it does when metrics.jsonl cannot be written.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from lmforge.monitor.base import RecordError


class RankLogHandler(logging.FileHandler):
    """A rank's log file that remembers its first failed write instead of printing a traceback for each."""

    def __init__(self, path: Path) -> None:
        """Append to `path`."""
        super().__init__(path, mode="a", encoding="utf-8")
        self.failure: str | None = None
        """What the first failed write said (None while every write succeeded)."""

    def handleError(self, record: logging.LogRecord) -> None:
        """Keep the first failure; the trainer reads it once per step."""
        if self.failure is None:
            error = sys.exc_info()[1]
            self.failure = f"writing {self.baseFilename} failed: {type(error).__name__}: {error}"

    def close(self) -> None:
        """Close the file; lines that a failure left in the buffer are dropped (the failure is already kept)."""
        try:
            super().close()
        except OSError as error:
            if self.failure is None:
                self.failure = f"writing {self.baseFilename} failed: {type(error).__name__}: {error}"


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    """The logger of this rank, appending (across resumes) to `logs/rank_<rank>.log`; `RecordError` when the file
    cannot be opened."""
    folder = run_dir / "logs"
    logger = logging.getLogger(f"lmforge.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    close_logger(logger)  # a second trainer in the same process (tests) starts a fresh handler
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handler = RankLogHandler(folder / f"rank_{rank}.log")
    except OSError as e:
        raise RecordError(f"opening {folder / f'rank_{rank}.log'} failed: {type(e).__name__}: {e}") from None
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


def log_failure(logger: logging.Logger) -> str | None:
    """The first failed write of the logger's files, if any."""
    return next((h.failure for h in logger.handlers if isinstance(h, RankLogHandler) and h.failure), None)


def close_logger(logger: logging.Logger) -> None:
    """Flush and close the logger's files."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
