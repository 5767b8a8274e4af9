"""Random kills: a run SIGKILLed at a random moment, then relaunched with the same command, ends exactly as the
uninterrupted run does, with a valid `latest`.

Each trial draws, from the suite's seed and its own number: 1 or 2 processes, a synchronous or an async checkpoint
save, and where the kill lands: in the middle of a step (a random micro-batch), while a checkpoint's shards are
written (a random item), with a checkpoint written but not renamed into place, renamed but not yet named by
`latest`, named by `latest` before older ones are removed, or from outside at a random time (the whole process
group, as a lost node). With 2 processes a kill from inside hits one random rank, and torchrun ends the other.
The relaunch is the command a requeued job runs (`--resume.step auto`). A trial passes when `latest` names a
complete checkpoint right after the kill, the relaunched run exits 0, its losses equal the uninterrupted run's bit
for bit, its metrics hold every step once, `latest` names the final checkpoint and that checkpoint is complete,
and no unfinished save is left in `checkpoints/`.

    pytest tests/chaos                                   # CI: 20 trials
    LMFORGE_CHAOS_TRIALS=300 pytest tests/chaos          # many more
    LMFORGE_CHAOS_SEED=1234 pytest tests/chaos           # replay a run's trials (the seed is printed at the end)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from lmforge.checkpoint.layout import is_complete, list_checkpoints, read_latest, step_name
from lmforge.monitor import read_metrics
from tests.chaos.chaos_run import POINTS
from tests.integration.runner import cli_command, env_one_thread, losses, write_config

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

CHAOS_RUN = Path(__file__).with_name("chaos_run.py")
STEPS = 8
INTERVAL = 2
TRIALS = int(os.environ.get("LMFORGE_CHAOS_TRIALS", "20"))
SEED = int(os.environ.get("LMFORGE_CHAOS_SEED", str(int(time.time()) % 100_000)))

# How many times each point occurs in a run (counted on this config): micro-batches per rank, DCP items the rank
# with the fewest writes writes over the run, commits.
OCCURRENCES = {"micro-batch": {1: 64, 2: 32}, "write": {1: 500, 2: 190}, "before-commit": {1: 4, 2: 4},
               "after-rename": {1: 4, 2: 4}, "after-latest": {1: 4, 2: 4}}  # fmt: skip
RESULTS: list[dict[str, object]] = []
"""Each trial's spec and outcome, printed at the end of the session (tests/chaos/conftest.py)."""


@dataclass(frozen=True)
class Trial:
    """One kill: where, when, and on how many processes."""

    index: int
    nproc: int
    async_save: bool
    point: str
    count: int
    """Which occurrence of `point` kills (for `none`: the kill comes from outside)."""
    rank: int
    delay: float
    """For `none`: the fraction of the uninterrupted run's duration after which the process group is killed."""

    @staticmethod
    def draw(index: int, seed: int) -> Trial:
        """The trial `index` of the suite run with `seed`."""
        rng = random.Random(seed * 1_000_003 + index)
        nproc = rng.choice((1, 2))
        point = rng.choice(POINTS)
        count = rng.randint(1, OCCURRENCES[point][nproc]) if point != "none" else 0
        return Trial(index, nproc, rng.random() < 0.5, point, count, rng.randrange(nproc), rng.uniform(0.05, 0.95))


def _command(cfg: Path, trial: Trial) -> list[str]:
    args = [trial.point, str(trial.count), "train", "@", str(cfg), "--ckpt.interval", str(INTERVAL),
            "--resume.step", "auto", *(["--ckpt.async"] if trial.async_save else [])]  # fmt: skip
    return cli_command(args, nproc=trial.nproc, script=CHAOS_RUN)


def _env(trial: Trial) -> dict[str, str]:
    return {**env_one_thread(), "CHAOS_RANK": str(trial.rank)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[list[float], float]]:
    """The uninterrupted run's losses and wall time, on 1 and on 2 processes."""
    out = {}
    for nproc in (1, 2):
        tmp = tmp_path_factory.mktemp(f"reference{nproc}")
        cfg = write_config(tmp, "run", max_steps=STEPS)
        t0 = time.perf_counter()
        trial = Trial(-1, nproc, False, "none", 0, 0, 0.0)
        result = subprocess.run(_command(cfg, trial), capture_output=True, text=True, timeout=240, env=_env(trial),
                                check=False)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        out[nproc] = (losses(tmp / "run"), time.perf_counter() - t0)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it, as a lost node loses them: torchrun starts its workers in sessions
    of their own, so killing its process group would leave them running."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while the table was read
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [pid], [pid]
    while todo:  # the whole tree first: once the parent dies, its children are no longer listed under it
        kids = children.get(todo.pop(), [])
        tree += kids
        todo += kids
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _killed_run(cfg: Path, trial: Trial, duration: float) -> int:
    """Run the trial's command until it dies (or ends); returns its exit status."""
    proc = subprocess.Popen(_command(cfg, trial), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(trial))  # fmt: skip
    try:
        if trial.point == "none":
            try:
                proc.wait(timeout=trial.delay * duration)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)  # torchrun and its workers, as a lost node
        proc.wait(timeout=240)
    finally:
        _kill_tree(proc.pid)  # nothing of the trial may outlive it (a worker torchrun left behind, say)
        proc.wait()
    return proc.returncode


def _problems(run: Path, expected: list[float], relaunch: subprocess.CompletedProcess[str]) -> list[str]:
    problems = []
    if relaunch.returncode != 0:
        return [f"the relaunch exited {relaunch.returncode}: {relaunch.stderr[-1500:]}"]
    got = losses(run)
    if got != expected:
        problems.append(f"losses differ from the uninterrupted run: {got} vs {expected}")
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    if steps != list(range(STEPS + 1)):
        problems.append(f"metrics steps {steps}")
    root = run / "checkpoints"
    latest = read_latest(root)
    if latest != STEPS or not is_complete(root / step_name(STEPS)):
        problems.append(f"latest is {latest}, checkpoints {list_checkpoints(root)}")
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    if leftovers:
        problems.append(f"unfinished saves left: {leftovers}")
    return problems


@pytest.mark.parametrize("index", range(TRIALS))
def test_a_killed_run_relaunched_ends_like_the_uninterrupted_one(
    reference: dict[int, tuple[list[float], float]], tmp_path: Path, index: int
) -> None:
    trial = Trial.draw(index, SEED)
    expected, duration = reference[trial.nproc]
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    status = _killed_run(cfg, trial, duration)
    root = tmp_path / "run" / "checkpoints"
    latest_after_kill = read_latest(root) if root.is_dir() else None
    # Whatever `latest` names right after the kill must be a complete checkpoint.
    valid = latest_after_kill is None or is_complete(root / step_name(latest_after_kill))
    relaunch = subprocess.run(_command(cfg, Trial(index, trial.nproc, trial.async_save, "none", 0, 0, 0.0)),
                              capture_output=True, text=True, timeout=240, env=_env(trial), check=False)  # fmt: skip
    problems = ([] if valid else [f"latest {latest_after_kill} names an incomplete checkpoint after the kill"]) + (
        _problems(tmp_path / "run", expected, relaunch)
    )
    killed = status != 0
    RESULTS.append({**asdict(trial), "seed": SEED, "killed": killed, "latest_after_kill": latest_after_kill,
                    "problems": problems})  # fmt: skip
    assert not problems, json.dumps(RESULTS[-1], indent=1)
