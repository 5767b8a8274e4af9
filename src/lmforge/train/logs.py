"""Per-rank log files: `<output_dir>/logs/rank_<k>.log`, so a problem on any rank leaves a trace on disk.

Rank 0 also shows its lines on the console (the rich monitor); the files keep every rank's startup facts, logged
steps, checkpoints, stop requests and the traceback of an exception that ends the run.
"""

from __future__ import annotations

import logging
from pathlib import Path


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    """The logger of this rank, appending (across resumes) to `logs/rank_<rank>.log`."""
    folder = run_dir / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"lmforge.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    close_logger(logger)  # a second trainer in the same process (tests) starts a fresh handler
    handler = logging.FileHandler(folder / f"rank_{rank}.log", mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


def close_logger(logger: logging.Logger) -> None:
    """Flush and close the logger's files."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
