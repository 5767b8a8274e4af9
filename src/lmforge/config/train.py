"""The root config of `lmforge train`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from lmforge.config.base import Section
from lmforge.config.ckpt import CkptConfig, ResumeConfig
from lmforge.config.data import DataConfig
from lmforge.config.launch import DeploymentConfig, SlurmConfig
from lmforge.config.model import ModelConfig
from lmforge.config.optim import OptimConfig, ScheduleConfig
from lmforge.config.parallel import ParallelConfig
from lmforge.config.val import EvalSnapshotsConfig, ValConfig
from lmforge.config.wandb import WandbConfig


class LogConfig(Section):
    """`[log]`: console and metrics-file output."""

    interval: int = Field(default=1, ge=1)
    """Write a console line and a metrics.jsonl record every interval steps (and at the first and the last step)."""

    spike_window: int = Field(default=100, ge=1)
    """Steps of history whose median the spike flags compare against (see docs/monitoring.md)."""

    loss_spike_factor: float = Field(default=1.5, gt=1)
    """`loss/spike` is 1 when the step's loss exceeds this factor x the running median loss."""

    grad_spike_factor: float = Field(default=3.0, gt=1)
    """`optim/grad_norm_spike` is 1 when the gradient norm exceeds this factor x its running median."""

    batch_hashes: bool = False
    """Log `batch/hash`, a 48-bit hash of the token ids, targets and loss masks each step trained on (computed on the
    host, no device read); `lmforge replay RUN --verify` recomputes it from the run's data (docs/monitoring.md)."""


class TokenizerConfig(Section):
    """`[tokenizer]`: the tokenizer whose ids the data holds."""

    name: str | None = None
    """A local tokenizer folder (tokenizer.json + tokenizer_config.json) or tokenizer.json file; sets the model's
    vocabulary (its length rounded up to 128) and the EOS id. Required with data.type = "tokens" or "sft"; unset, it
    is model.name's folder when that folder has a tokenizer.json."""


class TrainConfig(Section):
    """Everything a training run needs. Written back to `<output_dir>/config.toml`."""

    max_steps: int = Field(gt=0)
    """Number of optimizer steps of the run."""

    output_dir: str
    """Run directory: resolved config, metrics.jsonl, checkpoints, logs."""

    model: ModelConfig
    """The model."""

    tokenizer: TokenizerConfig = TokenizerConfig()
    """The tokenizer."""

    data: DataConfig
    """The training data."""

    optim: OptimConfig
    """The optimizer, chosen by `type`: muon when training from scratch, adamw when model.name loads pretrained
    weights (which AdamW trained)."""

    schedule: ScheduleConfig = ScheduleConfig()
    """The learning-rate schedule (docs/training.md#schedule)."""

    log: LogConfig = LogConfig()
    """Console and metrics output (docs/training.md#output, docs/monitoring.md)."""

    ckpt: CkptConfig = CkptConfig()
    """Checkpoints: interval, retention, async writing (docs/checkpoints.md)."""

    resume: ResumeConfig = ResumeConfig()
    """Where the run continues from (docs/checkpoints.md#resuming-resume)."""

    val: ValConfig = ValConfig()
    """Validation on held-out sets (docs/validation.md)."""

    eval_snapshots: EvalSnapshotsConfig = EvalSnapshotsConfig()
    """Model-only snapshots for an eval worker, `lmforge eval` (docs/validation.md)."""

    wandb: WandbConfig = WandbConfig()
    """Weights & Biases logging, off unless wandb.project is set (docs/monitoring.md)."""

    parallel: ParallelConfig = ParallelConfig()
    """The process group: how long a rank waits for the others (docs/training.md#when-a-rank-is-lost)."""

    deployment: DeploymentConfig = DeploymentConfig()
    """Nodes and processes per node of a launched run (`lmforge slurm`; docs/launch.md). Training ignores it."""

    slurm: SlurmConfig = SlurmConfig()
    """The Slurm job that `lmforge slurm` submits (docs/launch.md). Training ignores it."""

    @model_validator(mode="before")
    @classmethod
    def _default_optimizer(cls, data: Any) -> Any:
        # Muon is the pretraining default; a run that fine-tunes loaded weights keeps AdamW, which trained them.
        if isinstance(data, dict) and isinstance(data.get("optim"), dict) and "type" not in data["optim"]:
            model = data.get("model") if isinstance(data.get("model"), dict) else {}
            debug = model.get("debug") if isinstance(model.get("debug"), dict) else {}
            if model.get("name") and not debug.get("random_init"):
                data = {**data, "optim": {**data["optim"], "type": "adamw"}}
        return data
