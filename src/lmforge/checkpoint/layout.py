"""Where checkpoints live in a run directory and how they are named, found, kept and committed.

    <output_dir>/checkpoints/step_N/   one checkpoint (see `lmforge.checkpoint.checkpointer`)
    <output_dir>/checkpoints/latest    the step of the newest committed checkpoint, replaced atomically
    <output_dir>/snapshots/step_N/     model-only snapshots for the eval worker

A checkpoint is written under `.tmp_step_N` and renamed when complete; a replaced one waits under `.old_step_N`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
LATEST = "latest"
TRAINER_STATE = "trainer.json"
MODEL_FILES = "model"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit the configured model; the message names it."""


def step_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step}"


def is_complete(path: Path) -> bool:
    """Whether `path` holds a committed checkpoint (DCP metadata and trainer state both written)."""
    return (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()


def list_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints under a `checkpoints/` folder, ascending."""
    steps = []
    if root.is_dir():
        for child in root.iterdir():
            name = child.name
            if name.startswith("step_") and _is_number(name[5:]) and is_complete(child):
                steps.append(int(name[5:]))
    return sorted(steps)


def read_latest(root: Path) -> int | None:
    """The step `checkpoints/latest` names, if the file exists."""
    path = root / LATEST
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} should hold a step number, found bytes that are not text") from None
    if not _is_number(text):
        raise CheckpointError(f"{path} should hold a step number, found {text[:40]!r}")
    return int(text)


def _is_number(text: str) -> bool:
    """Whether `text` is a step number: ASCII digits only (`str.isdigit` also takes digits such as '²', which
    `int` refuses)."""
    return text.isascii() and text.isdigit()


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees either the old or the new content, never a torn one."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def find_checkpoint(path: Path, step: int | str, why: str = "resume.step = 'latest' but ") -> Path | None:
    """Resolve a resume request: `path` is a run directory or one checkpoint folder; `step` a number, `latest`
    or `auto`. Returns None only for `auto` when the run has no checkpoint yet. `why` begins the message when
    `latest` finds none (the default names the resume request)."""
    if (path / TRAINER_STATE).is_file() or path.name.startswith("step_"):
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete (no .metadata or {TRAINER_STATE})")
        if isinstance(step, int) and path.name != step_name(step):
            raise CheckpointError(f"resume.step = {step} but resume.path names the checkpoint {path}")
        return path
    root = path / CHECKPOINTS
    available = list_checkpoints(root)
    if isinstance(step, int):
        target = root / step_name(step)
        if not is_complete(target):
            have = ", ".join(map(str, available)) or "none"
            raise CheckpointError(f"no complete checkpoint for step {step} in {root} (complete checkpoints: {have})")
        return target
    latest = read_latest(root)
    if latest is None:
        if step == "auto":
            return None
        raise CheckpointError(f"{why}{root} has no checkpoint ({root / LATEST} is missing)")
    target = root / step_name(latest)
    if not is_complete(target):
        raise CheckpointError(f"{root / LATEST} names step {latest} but {target} is missing or incomplete")
    return target


def retained(steps: Iterable[int], keep_last: int, keep_interval: int | None) -> set[int]:
    """The checkpoint steps retention keeps: the keep_last newest and every multiple of keep_interval."""
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:])
    if keep_interval:
        keep |= {s for s in ordered if s % keep_interval == 0}
    return keep


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state (`trainer.json`) of a checkpoint."""
    return json.loads((path / TRAINER_STATE).read_text())


def data_position_before(run_dir: Path, step: int) -> tuple[int, dict[str, Any] | None]:
    """Where a run's data stream stood before `step`: the step of its newest complete checkpoint before `step` and
    that checkpoint's saved data position, or (0, None), the start of the run, when it has none."""
    earlier = [s for s in list_checkpoints(run_dir / CHECKPOINTS) if s < step]
    for k in reversed(earlier):
        state = read_trainer_state(run_dir / CHECKPOINTS / step_name(k))
        if "data" in state:
            return k, state["data"]
    return 0, None

