"""Talking to Slurm from the submitting machine: `sbatch` a script, read a job's state."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from lmforge.launch.sbatch import LaunchError

TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
"""Job states after which a job runs no more (a requeued job passes through PENDING again instead)."""


def _run(command: list[str], what: str, timeout: float = 60.0) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LaunchError(
            f"{command[0]} not found on PATH: {what} needs the Slurm client commands (run this on a login node "
            "of the cluster, or install slurm-client)"
        ) from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{command[0]} did not answer within {timeout:.0f} s ({what})") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        raise LaunchError(f"{command[0]} refused {what}: {message}")
    return done.stdout


def submit(script: Path) -> str:
    """Submit `script` with `sbatch --parsable`; returns the job id. Raises `LaunchError` with Slurm's own message
    when sbatch is missing or refuses the job."""
    out = _run(["sbatch", "--parsable", str(script)], f"the job {script}")
    job_id = out.strip().splitlines()[-1].split(";")[0] if out.strip() else ""
    if not job_id.isdigit():
        raise LaunchError(f"sbatch accepted {script} but printed no job id: {out.strip()!r}")
    return job_id


def job_records(job_id: str) -> list[dict[str, str]]:
    """The fields of `scontrol show job` for the job, one record per job (an array job has one per task); empty
    once Slurm no longer knows it."""
    try:
        out = _run(["scontrol", "show", "job", "-o", job_id], f"the query of job {job_id}")
    except LaunchError as e:
        if "Invalid job id" in str(e):
            return []
        raise
    records = []
    for line in out.splitlines():
        fields: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        if fields:
            records.append(fields)
    return records


def wait_for_job(job_id: str, timeout: float, poll_s: float = 1.0) -> list[str]:
    """Wait until the job (every task of an array job) has ended; returns the final states, one per record, or
    an empty list when Slurm forgot the job before it was seen to end (after MinJobAge). Raises `LaunchError`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        states = [r.get("JobState", "UNKNOWN") for r in job_records(job_id)]
        if all(state in TERMINAL_STATES for state in states):
            return states
        if time.monotonic() > deadline:
            raise LaunchError(f"job {job_id} is still {', '.join(sorted(set(states)))} after {timeout:.0f} s")
        time.sleep(poll_s)
