"""`[deployment]` and `[slurm]`: where a run's processes go, and the Slurm job that starts them (`lmforge slurm`).

`lmforge train` ignores both sections: they describe the launch, not the training, so one config file serves a
laptop run under torchrun and a many-node Slurm job alike.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from lmforge.config.base import Section

_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED)$")
"""The time-limit forms sbatch accepts: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED."""

_MEM = re.compile(r"^\d+[KMGT]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _one_line(value: str | None) -> str | None:
    # Every value lands on a line of a shell script; a line break would start a line nobody wrote.
    if value is not None and ("\n" in value or "\r" in value):
        raise ValueError("must be one line (no line breaks)")
    return value


class DeploymentConfig(Section):
    """`[deployment]`: how many machines and processes a launched run uses."""

    num_nodes: int = Field(default=1, ge=1)
    """Machines (Slurm nodes) the run spans; the world size is num_nodes x procs_per_node."""

    procs_per_node: int = Field(default=1, ge=1)
    """Training processes per node, one per GPU on GPU machines (torchrun's --nproc-per-node)."""

    rdzv_port: int = Field(default=29500, ge=1, le=65535)
    """TCP port of the rendezvous store that torchrun starts on the job's first node (c10d rendezvous)."""


class SlurmConfig(Section):
    """`[slurm]`: the sbatch job `lmforge slurm` writes and submits (docs/launch.md). Unset fields are left to the
    cluster's defaults."""

    job_name: str | None = None
    """Slurm job name (sbatch --job-name); unset: the name of output_dir."""

    partition: str | None = None
    """Partition to submit to (--partition); unset: the cluster's default partition."""

    account: str | None = None
    """Account charged for the job (--account)."""

    qos: str | None = None
    """Quality of service (--qos)."""

    time: str | None = None
    """Time limit (--time): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS; unset: the partition's limit."""

    constraint: str | None = None
    """Node features the job needs (--constraint), e.g. "h100"."""

    exclusive: bool = False
    """Ask for whole nodes (--exclusive), shared with no other job."""

    gpus_per_node: int | None = Field(default=None, ge=1)
    """GPUs to request on each node (--gpus-per-node), usually deployment.procs_per_node; unset on CPU clusters
    and where a partition hands out whole nodes."""

    cpus_per_task: int | None = Field(default=None, ge=1)
    """CPUs for each node's task (--cpus-per-task), shared by the node's procs_per_node processes; it also sets
    OMP_NUM_THREADS to cpus_per_task / procs_per_node. Unset: the cluster's default, and OMP_NUM_THREADS=1."""

    mem: str | None = None
    """Memory per node (--mem), e.g. "256G"; "0" asks for all of it. Unset: the cluster's default."""

    extra_sbatch: list[str] = Field(default_factory=list)
    """Further sbatch options, one per item, as `#SBATCH --mail-type=END` or just `--mail-type=END`; written
    after the ones above, so they can override them."""

    env: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Environment variables set on every node before the training starts (values are quoted for the shell);
    they override lmforge's defaults (OMP_NUM_THREADS, PYTHONUNBUFFERED, the NCCL settings in docs/launch.md)."""

    setup: list[str] = Field(default_factory=list)
    """Shell lines run first in the job, before anything else, e.g. `module load cuda/12.4` or
    `source /shared/venvs/lmforge/bin/activate`."""

    template_path: str | None = None
    """A Jinja template for the sbatch script instead of the built-in one (`lmforge slurm --print-template`
    prints that one to start from); an unknown variable in it is an error that names the variable."""

    requeue: bool = False
    """After a stop signal (slurm.signal_before_s, `scancel --signal=TERM --batch`) and its checkpoint, put the job
    back in the queue (`scontrol requeue`); the next start resumes from the newest checkpoint (resume.step =
    "auto"). Also lets Slurm requeue the job after a node failure."""

    signal_before_s: int = Field(default=120, ge=0, le=65535)
    """Seconds before the time limit at which Slurm sends SIGTERM to the job (--signal=B:TERM@N): the training
    then checkpoints after its current step and stops. Make it longer than one step plus one checkpoint save (Slurm
    may send it up to 60 s early). 0: no signal before the limit."""

    @field_validator("job_name", "partition", "account", "qos", "constraint", "template_path")
    @classmethod
    def _single_line(cls, value: str | None) -> str | None:
        return _one_line(value)

    @field_validator("job_name")
    @classmethod
    def _job_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("time", "mem", mode="before")
    @classmethod
    def _number_as_text(cls, value: Any) -> Any:
        # `time = 30` (minutes) and `mem = 0` (all of it) are what sbatch takes: numbers are fine too.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not _TIME.match(value):
            raise ValueError(
                f"{value!r} is not a Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)"
            )
        return value

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not _MEM.match(value):
            raise ValueError(f"{value!r} is not a Slurm memory size (a number with an optional K, M, G or T)")
        return value

    @field_validator("extra_sbatch", mode="after")
    @classmethod
    def _extra_sbatch(cls, lines: list[str]) -> list[str]:
        out = []
        for line in lines:
            _one_line(line)
            text = line.strip()
            if text.startswith("--"):
                text = f"#SBATCH {text}"
            if not text.startswith("#SBATCH --"):
                raise ValueError(f"{line!r} is not an sbatch option (write '#SBATCH --name=value' or '--name=value')")
            out.append(text)
        return out

    @field_validator("setup", mode="after")
    @classmethod
    def _setup(cls, lines: list[str]) -> list[str]:
        for line in lines:
            _one_line(line)
        return lines

    @field_validator("env", mode="after")
    @classmethod
    def _env(cls, env: dict[str, Any]) -> dict[str, Any]:
        for name, value in env.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits and _)")
            if isinstance(value, str):
                _one_line(value)
        return env

    def env_strings(self) -> dict[str, str]:
        """`env` with every value as the shell sees it (TOML true -> "1", false -> "0")."""
        return {k: (str(int(v)) if isinstance(v, bool) else str(v)) for k, v in self.env.items()}
