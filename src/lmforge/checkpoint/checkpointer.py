"""Writing sharded checkpoints (torch.distributed.checkpoint) with an atomic commit and retention.

Layout of one checkpoint, `<output_dir>/checkpoints/step_N/`:

    .metadata, __<rank>_0.distcp   DCP: model and optimizer, each rank writing its own shards
    trainer.json                   step, token counter, schedule start, data position, world size
    rng/rank_<k>.pt                RNG states of rank k, tensors and plain values only (`RNG_FORMAT`),
                                   restored when the world size is unchanged
    config.toml                    the resolved config of the run when it was saved
    model/                         HF config.json, generation_config.json and tokenizer files (for export)

Everything is written into `checkpoints/.tmp_step_N/`, which is renamed to `step_N` once complete; only then is
`checkpoints/latest` (a file holding the step number) replaced. A crash at any moment therefore leaves `latest`
naming a complete checkpoint, and leftovers of an interrupted save are never mistaken for one. Reading them back
is `lmforge.checkpoint.load`'s job.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from lmforge.checkpoint.layout import (
    CHECKPOINTS,
    LATEST,
    OLD_PREFIX,
    SNAPSHOTS,
    TMP_PREFIX,
    TRAINER_STATE,
    CheckpointError,
    list_checkpoints,
    read_latest,
    retained,
    step_name,
    write_atomic,
)
from lmforge.checkpoint.payload import optimizers_of, plain_state
from lmforge.checkpoint.rng_state import rng_state
from lmforge.config.ckpt import CkptConfig
from lmforge.parallel.experts import global_view
from lmforge.parallel.process_group import DistContext


def _failure_cause(err: BaseException) -> str:
    """The first underlying error of a failed DCP save, as `Type: message` (DCP wraps each rank's in a
    CheckpointException whose text is a list of tracebacks)."""
    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            return _failure_cause(inner)
    return f"{type(err).__name__}: {err}"


class Checkpointer:
    """Writes this rank's part of each checkpoint; rank 0 commits (rename, `latest`) and applies retention.

    With `model_only`, it writes the model-only snapshots of `<output_dir>/snapshots/` for the eval worker
    instead: weights and the step, committed the same way, never deleted here (the worker deletes what it scored).
    """

    def __init__(self, run_dir: Path, cfg: CkptConfig, ctx: DistContext, extra_files: dict[str, Path],
                 model_only: bool = False) -> None:  # fmt: skip
        """`extra_files` maps names inside the checkpoint to files or folders rank 0 copies in (config, model/)."""
        self.root = run_dir / (SNAPSHOTS if model_only else CHECKPOINTS)
        self.model_only = model_only
        self.cfg = cfg
        self.ctx = ctx
        self.extra_files = extra_files
        # Background writes run their collectives on a group of their own, so they never interleave with the
        # training step's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if cfg.async_save else None
        self._pending: tuple[Future[Any], int] | None = None
        if ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob(f"{TMP_PREFIX}*"):
                # An interrupted save of an earlier process: never complete, never named by `latest`.
                shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()

    def save(self, step: int, model: nn.Module, optimizer: Any, state: dict[str, Any], commit: bool = True) -> float:
        """Checkpoint after `step` steps; returns the seconds the caller was blocked. With `commit=False` a
        synchronous save is written but named by `latest` only at the next `poll`, `wait` or `close`, as an async
        one is: the trainer first logs the step's metrics, so a relaunch from `latest` never misses that line."""
        t0 = time.perf_counter()
        self.wait()
        tmp = self.root / f"{TMP_PREFIX}{step_name(step)}"

        def prepare() -> None:
            if not self.ctx.is_main:
                return
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
            (tmp / TRAINER_STATE).write_text(
                json.dumps({**state, "step": step, "world_size": self.ctx.world_size}, indent=1) + "\n"
            )
            for name, src in self.extra_files.items():
                if src.is_dir():
                    shutil.copytree(src, tmp / name)
                elif src.is_file():
                    shutil.copy2(src, tmp / name)

        self._on_every_rank(step, prepare)  # the folder exists before any rank writes into it
        if self.model_only:
            payload: dict[str, Any] = {"model": get_model_state_dict(model)}
        else:
            self._on_every_rank(step, lambda: torch.save(rng_state(), tmp / "rng" / f"rank_{self.ctx.rank}.pt"))
            model_sd, optim_sd = get_state_dict(model, optimizers_of(optimizer))
            payload = {"model": model_sd, "optim": optim_sd}
        payload = global_view(plain_state(payload), model)
        if self.cfg.async_save:
            future = dcp.async_save(payload, checkpoint_id=tmp, process_group=self.group)
            self._pending = (future, step)  # type: ignore[assignment]
        else:
            try:
                dcp.save(payload, checkpoint_id=tmp)
            except (Exception, CheckpointException) as err:
                raise self._failed(step, err) from None
            if commit:
                self._commit(step)
            else:
                written: Future[Any] = Future()
                written.set_result(None)
                self._pending = (written, step)
        return time.perf_counter() - t0

    def poll(self) -> None:
        """Commit a finished background save or a written, not yet committed one (cheap; called every step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until a background save is written, then commit it."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as err:
            raise self._failed(step, err) from None
        self._commit(step)

    def _on_every_rank(self, step: int, work: Callable[[], object]) -> None:
        """Run this rank's part of a save, then agree with the other ranks (a barrier): a failure on any rank (a
        full disk) makes every rank raise the same CheckpointError, instead of leaving the others waiting in the
        next collective."""
        error = None
        try:
            work()
        except OSError as err:
            error = f"{_failure_cause(err)} (on rank {self.ctx.rank})"
        errors: list[str | None] = [error]
        if self.ctx.world_size > 1:
            errors = [None] * self.ctx.world_size
            dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e is not None]
        if failed:
            raise self._failed(step, failed[0])

    def _failed(self, step: int, err: BaseException | str) -> CheckpointError:
        """A failed save (a full disk, a lost file system): its unfinished folder removed, so nothing partial is
        left for a resume to find, and the error every rank raises, naming the cause and what `latest` still
        names. DCP reports a failure on any rank to all of them, so every rank gets here."""
        latest = read_latest(self.root)
        full = self._disk_full_note(latest)
        if self.ctx.is_main:
            shutil.rmtree(self.root / f"{TMP_PREFIX}{step_name(step)}", ignore_errors=True)
        kept = f"latest still names {step_name(latest)}" if latest is not None else "there is no earlier checkpoint"
        cause = err if isinstance(err, str) else _failure_cause(err)
        return CheckpointError(
            f"saving checkpoint {step_name(step)} into {self.root} failed: {cause}{full}; its partial files were "
            f"removed and {kept}"
        )

    def _disk_full_note(self, latest: int | None) -> str:
        """A note when the file system has less room left than a checkpoint takes: some writers (torch's zip
        files) report a full disk only as a failed write."""
        if latest is None or not (self.root / step_name(latest)).is_dir():
            return ""
        size = sum(f.stat().st_size for f in (self.root / step_name(latest)).rglob("*") if f.is_file())
        free = shutil.disk_usage(self.root).free
        return f" (the disk is full: {free:,} bytes free, a checkpoint takes {size:,})" if free < size else ""

    def _commit(self, step: int) -> None:
        # DCP's save returns on rank 0 only after every rank's shards and the metadata are written.
        if not self.ctx.is_main:
            return
        tmp, final = self.root / f"{TMP_PREFIX}{step_name(step)}", self.root / step_name(step)
        old = self.root / f"{OLD_PREFIX}{step_name(step)}"
        if final.exists():  # a checkpoint of an abandoned continuation of this run (resumed from earlier)
            if read_latest(self.root) == step:
                # `latest` must name a complete checkpoint at every moment, also while step_N is swapped out.
                earlier = [s for s in list_checkpoints(self.root) if s < step]
                if earlier:
                    write_atomic(self.root / LATEST, f"{earlier[-1]}\n")
                else:
                    (self.root / LATEST).unlink()
            os.replace(final, old)
        os.replace(tmp, final)
        write_atomic(self.root / LATEST, f"{step}\n")
        shutil.rmtree(old, ignore_errors=True)
        if not self.model_only:
            self._apply_retention(step)

    def _apply_retention(self, current: int) -> None:
        steps = [s for s in list_checkpoints(self.root) if s <= current]
        keep = retained(steps, self.cfg.keep_last, self.cfg.keep_interval)
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.root / step_name(s), ignore_errors=True)

    def close(self) -> None:
        """Finish a background save (every rank), so no process exits with its shards half-written."""
        self.wait()
