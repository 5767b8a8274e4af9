"""Weights & Biases: the metrics of logged steps as a W&B run, which a resumed training run continues."""

from __future__ import annotations

import math
import os
import secrets
import string
from pathlib import Path
from typing import Any

from lmforge.config.wandb import WandbConfig

RUN_ID_FILE = "wandb_run_id"
"""File in the run directory holding the W&B run id, so that a resumed run logs to the same W&B run."""

EVAL_RUN_ID_FILE = "wandb_eval_run_id"
"""File in the run directory holding the id of the W&B run of `lmforge eval`, continued when the worker restarts."""

MOE_SECTIONS = ("max_vio", "expert_load")
"""Metric sections of mixture-of-experts layers; W&B shows them inside a `moe/` section (see `wandb_key`)."""

SUMMARY_SECTIONS = ("params",)
"""Metric sections that describe the run rather than a step: they go to the W&B run summary, not its history."""


def wandb_key(key: str) -> str:
    """The W&B name of metric `key`.

    W&B puts each chart in the panel section named by the part of its key before the first `/`. Most lmforge
    sections (`loss/`, `optim/`, `perf/`, `val/`, `moe/`) are meant to be W&B sections as they are; the MoE ones
    in `MOE_SECTIONS` get a `moe/` prefix so that all router statistics share one section:
    `max_vio/mean` -> `moe/max_vio/mean`, `expert_load/layer_3/cv` -> `moe/expert_load/layer_3/cv`.
    """
    return f"moe/{key}" if key.split("/", 1)[0] in MOE_SECTIONS else key


def _new_run_id() -> str:
    # W&B run ids become URL parts: lowercase letters and digits, like the ones W&B makes itself.
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _write_atomic(path: Path, text: str) -> None:
    # A run killed mid-write must not leave a truncated id, which would start an unrelated W&B run on resume.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class WandbMonitor:
    """Logs metrics to a W&B run; a no-op unless `cfg.enabled` (so `wandb` is imported only when used).

    Not part of the run's record: when a call fails, training goes on and the failures are counted in
    `monitor/failures/wandb` (`lmforge.monitor.base`). W&B writes every logged step to its local run files first
    (`<run_dir>/wandb/`, or `[wandb] dir`), so what it could not send is kept there for `wandb sync`.

    The run id is kept in `<run_dir>/wandb_run_id`: a run resumed from a checkpoint (`start_step > 0`) continues
    that W&B run, while a run that starts at step 0 makes a new one (and replaces a leftover id, e.g. after
    `--overwrite`). Online, W&B ignores steps below the last step the run holds, so after a resume the steps between
    the checkpoint and the previous attempt's last logged step keep the previous attempt's values in W&B.
    """

    name = "wandb"
    """Name in `monitor/failures/<name>`."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any], start_step: int = 0,
                 job: str = "train") -> None:  # fmt: skip
        """Start (or continue) the W&B run of the training run in `run_dir`; `config` is the run's resolved config
        (JSON types), stored as the W&B config, and `start_step` the step training starts from.

        With `job = "eval"` (the eval worker beside the training), the W&B run is a second one, `<name>-eval` in the
        same project and group, job type `eval`, whose config also holds `train_run_id`, the training's W&B run id:
        two processes cannot append to one W&B run's history. Its steps are the snapshots' training steps. It is
        continued whenever `wandb_eval_run_id` exists (a restarted worker goes on where it was)."""
        self.run: Any = None
        if not cfg.enabled:
            return
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "[wandb] project is set but the wandb package is not installed: pip install 'lmforge[wandb]'"
            ) from e
        run_dir = Path(run_dir)
        evaluating = job == "eval"
        id_file = run_dir / (EVAL_RUN_ID_FILE if evaluating else RUN_ID_FILE)
        resume = evaluating or start_step > 0
        run_id = id_file.read_text(encoding="utf-8").strip() if resume and id_file.exists() else ""
        if evaluating:
            train_id = run_dir / RUN_ID_FILE
            config = {**config, "train_run_id": train_id.read_text().strip() if train_id.exists() else None}
        name = cfg.name or run_dir.resolve().name
        root = Path(cfg.dir) if cfg.dir is not None else run_dir
        for folder in (run_dir, root):
            folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=f"{name}-eval" if evaluating else name,
            group=cfg.group,
            job_type=job,
            tags=cfg.tags,
            mode=cfg.mode,
            dir=root,
            id=run_id or _new_run_id(),
            resume="allow",
            config=config,
            # A resumed run may change settings (max_steps, lr, ...): its config replaces the stored one.
            allow_val_change=True,
            # Never finish another W&B run of this process (e.g. one started by the user around training).
            reinit="create_new",
            # The console already shows progress; W&B's banner lines and its capture of the redrawn progress
            # bar would only add noise (the run directory keeps the logs).
            settings=wandb.Settings(silent=True, console="off"),
        )
        _write_atomic(id_file, self.run.id + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log the metrics of step `step` under their W&B names (`wandb_key`); `params/*` go to the run summary.

        NaN and infinite values are left out: W&B cannot plot them, and metrics.jsonl keeps them (as null).
        """
        if self.run is None:
            return
        history: dict[str, Any] = {}
        summary: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, int | float) and not math.isfinite(value):
                continue
            target = summary if key.split("/", 1)[0] in SUMMARY_SECTIONS else history
            target[wandb_key(key)] = value
        if summary:
            self.run.summary.update(summary)
        if history:
            self.run.log(history, step=step)

    def close(self) -> None:
        """Finish the W&B run (in offline mode: close its local files)."""
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
