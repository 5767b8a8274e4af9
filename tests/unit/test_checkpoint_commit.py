"""`latest` names a complete checkpoint at every moment of a commit, also when a save replaces a checkpoint of an
abandoned continuation of the run (a run resumed from an earlier step in its own folder)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmforge.checkpoint import checkpointer
from lmforge.checkpoint.layout import is_complete, list_checkpoints, read_latest, step_name
from lmforge.parallel.process_group import DistContext, init_distributed
from tests.unit.test_checkpoint import _save


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


class _Killed(BaseException):
    """Stands for the process dying at this point."""


@pytest.mark.parametrize("latest_before", [4, 6])
def test_replacing_the_checkpoint_latest_names_keeps_latest_valid(
    ctx: DistContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, latest_before: int
) -> None:
    for step in (2, 4, 6)[: (2, 4, 6).index(latest_before) + 1]:
        _save(ctx, tmp_path, step, keep_last=5)
    root = tmp_path / "checkpoints"
    assert read_latest(root) == latest_before
    # The run resumed from step 2 saves step 4 again; the process dies between moving the old step_4 aside and
    # renaming the new one into place.
    real_replace = os.replace
    moved_aside = []

    def replace(src: Path, dst: Path) -> None:
        if Path(dst).name == ".old_step_4":
            moved_aside.append(True)
        if Path(src).name == ".tmp_step_4" and Path(dst).name == "step_4":
            raise _Killed
        real_replace(src, dst)

    monkeypatch.setattr(checkpointer.os, "replace", replace)
    with pytest.raises(_Killed):
        _save(ctx, tmp_path, 4, keep_last=5)
    monkeypatch.undo()
    assert moved_aside and not (root / "step_4").exists()  # the moment between the two renames
    latest = read_latest(root)
    assert latest is not None and is_complete(root / step_name(latest)), (latest, list_checkpoints(root))
    # The steps `latest` may name: the one it named when that is still there, else the newest complete before 4.
    assert latest == (6 if latest_before == 6 else 2)
