"""The sbatch script of a training run: a Jinja template (the built-in one or `slurm.template_path`) filled from
the resolved config.

Rendering uses `StrictUndefined`, so a template that names a variable this module does not provide fails with the
variable's name instead of writing an empty string into a job script.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from lmforge.config.train import TrainConfig

BUILTIN_TEMPLATE = "train.sbatch.j2"
"""The built-in template, a file of the package `lmforge.launch.templates`."""

SLURM_DIR = "slurm"
"""Folder of the run directory holding the job script (and the nodes' pid files while the job runs)."""

SCRIPT_NAME = "job.sbatch"
"""File name of the written job script, under `<output_dir>/slurm/`."""


class LaunchError(Exception):
    """A launch that cannot go ahead: a bad template, a missing `sbatch`, a refused submission."""


NCCL_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NCCL_DEBUG": "WARN",
}
"""NCCL settings every node gets unless `slurm.env` overrides them: a failed collective tears the process down
(so the job ends instead of hanging), FSDP frees all-gathered buffers without record_stream, and NCCL reports
warnings only."""


def builtin_template() -> str:
    """The text of the built-in sbatch template."""
    return resources.files("lmforge.launch.templates").joinpath(BUILTIN_TEMPLATE).read_text(encoding="utf-8")


def job_env(config: TrainConfig) -> dict[str, str]:
    """The environment every node sets before torchrun: threads, unbuffered output, NCCL, then `slurm.env`."""
    slurm, procs = config.slurm, config.deployment.procs_per_node
    threads = max(1, slurm.cpus_per_task // procs) if slurm.cpus_per_task else 1
    return {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **NCCL_DEFAULTS, **slurm.env_strings()}


@dataclass(frozen=True)
class JobFiles:
    """Where a run's job writes: its script, resolved config and logs (absolute paths)."""

    run_dir: Path
    """The run directory (output_dir)."""

    @property
    def script(self) -> Path:
        """The sbatch script."""
        return self.run_dir / SLURM_DIR / SCRIPT_NAME

    @property
    def config(self) -> Path:
        """The resolved config the job trains with."""
        return self.run_dir / "config.toml"

    @property
    def logs(self) -> Path:
        """Folder of the job log (`slurm_<jobid>.log`), the node logs (`node_<i>.log`) and the rank logs."""
        return self.run_dir / "logs"

    def job_log(self, job_id: str) -> Path:
        """The batch script's own log: starts, stop signals, requeues, the exit status."""
        return self.logs / f"slurm_{job_id}.log"

    def node_log(self, node: int) -> Path:
        """Everything torchrun and the training processes of node `node` (0-based, in job order) print."""
        return self.logs / f"node_{node}.log"


def template_context(config: TrainConfig, files: JobFiles, workdir: Path) -> dict[str, Any]:
    """The variables a template sees (docs/launch.md lists them)."""
    return {
        "job_name": config.slurm.job_name or files.run_dir.name,
        "num_nodes": config.deployment.num_nodes,
        "procs_per_node": config.deployment.procs_per_node,
        "rdzv_port": config.deployment.rdzv_port,
        "run_dir": str(files.run_dir),
        "config_path": str(files.config),
        "script_path": str(files.script),
        "log_dir": str(files.logs),
        "workdir": str(workdir),
        "python": sys.executable,
        "max_steps": config.max_steps,
        "env": job_env(config),
        "slurm": config.slurm,
        "deployment": config.deployment,
    }


def _load_template(config: TrainConfig) -> tuple[str, str]:
    path = config.slurm.template_path
    if path is None:
        return builtin_template(), "the built-in sbatch template"
    try:
        return Path(path).read_text(encoding="utf-8"), f"slurm.template_path {path}"
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise LaunchError(f"slurm.template_path {path}: cannot be read: {reason}") from None


def render_script(config: TrainConfig, files: JobFiles, workdir: Path) -> str:
    """The sbatch script of the run. Raises `LaunchError` naming the template and the line or variable at fault."""
    text, name = _load_template(config)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    context = template_context(config, files, workdir)
    try:
        return env.from_string(text).render(**context)
    except jinja2.TemplateSyntaxError as e:
        raise LaunchError(f"{name}, line {e.lineno}: {e.message}") from None
    except jinja2.UndefinedError as e:
        raise LaunchError(f"{name}: {e.message} (the variables are: {', '.join(sorted(context))})") from None
