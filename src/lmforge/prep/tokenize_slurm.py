"""`lmforge tokenize --slurm`: the same datatrove pipeline as the local run, submitted through datatrove's own
`SlurmPipelineExecutor` as one array job per output folder (each of its `--tasks` tasks is one array task).

The submitting machine checks everything first (`plan_tokenize`), so bad input never reaches the queue. The jobs
write into the same folders, with the same files, as the local executor: every task runs the same steps, including
the sweep of its empty files.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datatrove.executor import SlurmPipelineExecutor

from lmforge.config.launch import SlurmConfig
from lmforge.launch.sbatch import LaunchError
from lmforge.launch.submit import wait_for_job
from lmforge.prep.text_sources import SourceError
from lmforge.prep.tokenize import LOG_DIR_NAME, ShardSummary, TokenizeJob, TokenizePlan, summarize_shards


class _Executor(SlurmPipelineExecutor):
    """datatrove's Slurm executor, leaving out the sbatch options lmforge's config leaves unset (datatrove writes
    `--partition=None` otherwise) so that the cluster's defaults apply."""

    def get_sbatch_args(self, max_array: int = 1) -> dict[str, Any]:
        """datatrove's options without the unset ones; `slurm.mem` replaces the per-CPU memory."""
        args = super().get_sbatch_args(max_array)
        if "mem" in args:
            args.pop("mem-per-cpu", None)
        return {k: v for k, v in args.items() if v is not None and v != "None"}


def _extra_options(lines: list[str]) -> dict[str, str]:
    # datatrove takes sbatch options as a {name: value} table; "" writes a bare flag.
    options = {}
    for line in lines:
        name, _, value = line.removeprefix("#SBATCH").strip().removeprefix("--").partition("=")
        options[name] = value
    return options


def _setup_command(slurm: SlurmConfig) -> str:
    # The job runs datatrove's `launch_pickled_pipeline` and `merge_stats` scripts, which sit beside this Python.
    lines = [*slurm.setup, f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in slurm.env_strings().items()]
    return "\n".join(lines)


def slurm_executor(
    job: TokenizeJob, pipeline: list[Any], slurm: SlurmConfig, tasks: int, workers: int | None
) -> _Executor:
    """The Slurm executor of one tokenize job: `tasks` array tasks, at most `workers` of them at once (None: no
    limit), with the `[slurm]` fields that apply to a CPU job."""
    extra = {
        **({"account": slurm.account} if slurm.account else {}),
        **({"constraint": slurm.constraint} if slurm.constraint else {}),
        **({"exclusive": ""} if slurm.exclusive else {}),
        **({"mem": slurm.mem} if slurm.mem else {}),
        **_extra_options(slurm.extra_sbatch),
    }
    logs = job.output / LOG_DIR_NAME
    return _Executor(
        pipeline=pipeline,
        tasks=tasks,
        workers=workers if workers is not None else -1,
        time=slurm.time,  # type: ignore[arg-type]  # None is dropped from the options
        partition=slurm.partition,  # type: ignore[arg-type]
        qos=slurm.qos,  # type: ignore[arg-type]
        cpus_per_task=slurm.cpus_per_task or 1,
        job_name=slurm.job_name or f"lmforge-tokenize-{job.label}",
        env_command=_setup_command(slurm),
        sbatch_args=extra,
        logging_dir=str(logs),
        slurm_logs_folder=str(logs / "slurm_logs"),
        skip_completed=False,
        requeue=slurm.requeue,
        mail_type="NONE",
    )


@dataclass(frozen=True)
class SubmittedJob:
    """A tokenize job in the queue."""

    job: TokenizeJob
    """Its output folder."""
    job_id: str
    """The Slurm id of its array job."""
    tasks: int
    """Its number of array tasks."""

    @property
    def slurm_logs(self) -> Path:
        """Folder of the Slurm output of each array task."""
        return self.job.output / LOG_DIR_NAME / "slurm_logs"


def submit_tokenize(plan: TokenizePlan, slurm: SlurmConfig) -> list[SubmittedJob]:
    """Submit every job of the plan; returns them with their job ids. Raises `LaunchError` when sbatch is missing
    or refuses a job (Slurm's message is printed just before, on stderr)."""
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch not found on PATH: --slurm needs the Slurm client commands (run on a login node)")
    submitted = []
    for job, pipeline in zip(plan.jobs, plan.pipelines, strict=True):
        executor = slurm_executor(job, pipeline, slurm, plan.tasks, plan.workers)
        try:
            executor.run()
        except subprocess.CalledProcessError as e:
            raise LaunchError(
                f"sbatch refused the {job.label} job (exit status {e.returncode}); see its message above"
            ) from None
        submitted.append(SubmittedJob(job, str(executor.job_id), plan.tasks))
    return submitted


def wait_tokenize(submitted: Sequence[SubmittedJob], timeout: float) -> list[tuple[TokenizeJob, ShardSummary]]:
    """Wait for the submitted jobs and return each with what its folder holds. Raises `SourceError` when a task did
    not finish, naming its job and the folder of the Slurm logs."""
    results = []
    for sub in submitted:
        states = wait_for_job(sub.job_id, timeout)
        done = len(list((sub.job.output / LOG_DIR_NAME / "completions").glob("*")))
        if done < sub.tasks:
            raise SourceError(
                f"{sub.job.label} job {sub.job_id}: {done} of {sub.tasks} tasks finished (states: "
                f"{', '.join(sorted(set(states))) or 'gone from the queue'}); see {sub.slurm_logs}"
            )
        results.append((sub.job, summarize_shards(sub.job.output)))
    return results
