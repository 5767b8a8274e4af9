"""The run directory before the step loop: start it, resume in it, or start it over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lmforge.checkpoint.layout import CHECKPOINTS, CheckpointError, find_checkpoint, read_trainer_state, write_atomic
from lmforge.config.loader import ConfigError, dump_toml
from lmforge.config.train import TrainConfig
from lmforge.monitor.jsonl import read_metrics


def _truncate_metrics(path: Path, last_step: int) -> None:
    # A resumed run rewrites the steps after its checkpoint; drop their old records so the file is one curve.
    if not path.exists():
        return
    records = read_metrics(path)  # a torn last line (a write cut off) is left out
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records if r["step"] <= last_step))


def prepare_output_dir(config: TrainConfig, overwrite: bool) -> Path | None:
    """Create the run directory and write the resolved config; returns the checkpoint to resume from, if any.

    A used output_dir is refused unless the run resumes from its own checkpoints (its metrics after the resumed
    step are dropped) or `overwrite` starts it over (its metrics and checkpoints are deleted).
    """
    out = Path(config.output_dir)
    metrics = out / "metrics.jsonl"
    resume = config.resume
    own = resume.path is None or Path(resume.path).resolve().is_relative_to(out.resolve())
    if resume.step is not None and own and overwrite:
        raise ConfigError("--overwrite deletes this run's checkpoints: it cannot be combined with resume.step")
    ckpt = find_checkpoint(Path(resume.path or out), resume.step) if resume.step is not None else None
    if metrics.exists():
        if ckpt is not None and own:
            _truncate_metrics(metrics, read_trainer_state(ckpt)["step"])
        elif resume.step == "auto" and own:
            metrics.unlink()  # the earlier attempt never reached a checkpoint: it starts over
        elif overwrite:
            metrics.unlink()
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        else:
            raise ConfigError(
                f"output_dir {out} already holds a run ({metrics} exists); choose another --output-dir, "
                "pass --overwrite to start over, or --resume.step latest to continue it"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(config), encoding="utf-8")
    return ckpt


def prepare_run(config: TrainConfig, overwrite: bool) -> Path | None:
    """`prepare_output_dir` on rank 0, its outcome shared with every rank: the checkpoint to resume from, or the
    same `ConfigError` raised on every rank, so that no rank waits alone for the others."""
    import torch.distributed as dist

    shared: list[object] = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            ckpt = prepare_output_dir(config, overwrite)
            shared[1] = None if ckpt is None else str(ckpt)
        except (ConfigError, CheckpointError) as e:
            shared[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise ConfigError(str(shared[0]))
    return None if shared[1] is None else Path(str(shared[1]))
