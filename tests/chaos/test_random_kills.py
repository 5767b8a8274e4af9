"""Random kills: a run SIGKILLed at a random moment, then relaunched with the same command, ends exactly as the
uninterrupted run does, with a valid `latest` and whole eval files.

The run validates (a held-out token folder and a ctxcont set whose scores it saves) and writes eval snapshots every
two steps, as well as checkpoints. Each trial draws, from the suite's seed and its own number: 1 or 2 processes, a
synchronous or an async checkpoint save, and where the kill lands (tests/chaos/chaos_run.py): in the middle of a
step (a random micro-batch), while a checkpoint's shards are written (a random item), with a checkpoint written but
not renamed into place, renamed but not yet named by `latest`, named by `latest` before older ones are removed,
while an eval snapshot is written or before it is renamed, in the middle of a validation round, or from outside at
a random time (the whole process group, as a lost node). With 2 processes a kill from inside hits one random rank,
and torchrun ends the other. Which occurrence of a point kills is drawn from a counting run of the same config, so
the draw follows the code when it changes how often a point comes.

The relaunch is the command a requeued job runs (`--resume.step auto`). A trial passes when `latest` names a
complete checkpoint right after the kill, the relaunched run exits 0, its losses and validation metrics equal the
uninterrupted run's bit for bit, its metrics hold every step once, `latest` names the final checkpoint and that
checkpoint is complete, every eval snapshot is complete and every saved score file whole and equal to the
uninterrupted run's, and no unfinished save is left.

A trial whose kill did not come (the run ended first) is not a pass: it is counted as "not reached", and the
session fails when more than `MAX_NOT_REACHED` of its trials were.

    pytest tests/chaos                                   # CI: 10 trials (20 with LMFORGE_LONG=1)
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

import numpy as np
import pytest

from lmforge.checkpoint.layout import is_complete, list_checkpoints, read_latest, step_name
from lmforge.monitor import read_metrics
from tests.chaos.chaos_run import KILLS, POINTS
from tests.chat import write_jsonl
from tests.integration.runner import cli_command, env_one_thread, losses, write_config
from tests.shards import random_docs, word_tokenizer, write_shard

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

CHAOS_RUN = Path(__file__).with_name("chaos_run.py")
STEPS = 8
INTERVAL = 2
TRIALS = int(os.environ.get("LMFORGE_CHAOS_TRIALS", "20" if os.environ.get("LMFORGE_LONG") == "1" else "10"))
SEED = int(os.environ.get("LMFORGE_CHAOS_SEED", str(int(time.time()) % 100_000)))
MAX_NOT_REACHED = 0.1
"""The share of a session's trials whose kill may not come (a kill from outside after the run ended) before the
session fails: more would mean the trials no longer test what they claim."""
RESULTS: list[dict[str, object]] = []
"""Each trial's spec and outcome, printed at the end of the session (tests/chaos/conftest.py)."""

COMMITS = ("before-commit", "after-rename", "after-latest", "snapshot-commit")
"""The kill points only rank 0 meets."""

Counts = dict[tuple[int, bool], list[dict[str, int]]]
"""(processes, async save) -> per rank, how often each kill point occurs in the uninterrupted run."""


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
    def draw(index: int, seed: int, counts: Counts) -> Trial:
        """The trial `index` of the suite run with `seed`; the occurrence is drawn from the counting run's."""
        rng = random.Random(seed * 1_000_003 + index)
        nproc, async_save, point = rng.choice((1, 2)), rng.random() < 0.5, rng.choice(POINTS)
        per_rank = counts[(nproc, async_save)]
        # A kill from inside hits a rank where its point comes (only rank 0 commits); one from outside hits all.
        rank = rng.choice([r for r in range(nproc) if point == "none" or per_rank[r][point] > 0])
        delay = rng.uniform(0.05, 0.95)
        count = rng.randint(1, per_rank[rank][point]) if point != "none" else 0
        return Trial(index, nproc, async_save, point, count, rank, delay)


@dataclass(frozen=True)
class Setup:
    """What every trial shares: the config's extra flags and the uninterrupted runs."""

    flags: list[str]
    """Flags of the validation sets, the tokenizer and the eval snapshots."""
    runs: dict[int, Path]
    """The uninterrupted run on 1 and 2 processes."""
    durations: dict[int, float]
    """Its wall time in seconds."""
    counts: Counts


def _command(cfg: Path, trial: Trial, flags: list[str]) -> list[str]:
    args = [trial.point, str(trial.count), "train", "@", str(cfg), *flags, "--ckpt.interval", str(INTERVAL),
            "--resume.step", "auto", *(["--ckpt.async"] if trial.async_save else [])]  # fmt: skip
    return cli_command(args, nproc=trial.nproc, script=CHAOS_RUN)


def _env(trial: Trial, **extra: str) -> dict[str, str]:
    return {**env_one_thread(), "CHAOS_RANK": str(trial.rank), **extra}


def _eval_flags(folder: Path) -> list[str]:
    """A tokenizer of the fake data's ids, a held-out token folder and a ctxcont set, scored every two steps with
    the scores saved, and eval snapshots every two steps."""
    tok = word_tokenizer(folder / "tok", size=200)
    write_shard(folder / "held", "00000", random_docs(12, seed=5, vocab=200))
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(1, 199, size=n))  # noqa: E731
    quiz = [{"context": words(5), "continuations": [" " + words(2) for _ in "abc"], "label": i % 3} for i in range(6)]
    write_jsonl(folder / "sets" / "quiz.ctxcont.jsonl", quiz)
    return ["--tokenizer.name", str(tok), "--val.interval", str(INTERVAL), "--val.data-dir", str(folder / "sets"),
            "--val.sets", f'[{{name = "held", path = "{folder / "held"}"}}, "quiz"]', "--val.save-arrays",
            "--eval-snapshots.interval", str(INTERVAL)]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """The uninterrupted runs on 1 and 2 processes, each also a counting run (sync and async saves)."""
    flags = _eval_flags(tmp_path_factory.mktemp("eval"))
    runs, durations, counts = {}, {}, {}
    for nproc in (1, 2):
        for async_save in (False, True):
            tmp = tmp_path_factory.mktemp(f"count{nproc}{'a' if async_save else 's'}")
            cfg = write_config(tmp, "run", max_steps=STEPS)
            trial = Trial(-1, nproc, async_save, "none", 0, 0, 0.0)
            (tmp / "counts").mkdir()
            t0 = time.perf_counter()
            result = subprocess.run(_command(cfg, trial, flags), capture_output=True, text=True, timeout=300,
                                    env=_env(trial, CHAOS_COUNTS=str(tmp / "counts")), check=False)  # fmt: skip
            assert result.returncode == 0, result.stderr[-3000:]
            counts[(nproc, async_save)] = [json.loads((tmp / "counts" / f"rank_{r}.json").read_text())
                                           for r in range(nproc)]  # fmt: skip
            if not async_save:
                runs[nproc], durations[nproc] = tmp / "run", time.perf_counter() - t0
    for key, per_rank in counts.items():
        # Rank 0 meets every point; the others all but the commits, which rank 0 makes alone.
        for rank, c in enumerate(per_rank):
            missing = [p for p in KILLS if c[p] == 0 and (rank == 0 or p not in COMMITS)]
            assert not missing, f"{key}: rank {rank} never reached {missing}"
    return Setup(flags, runs, durations, counts)


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


def killed_run(cfg: Path, trial: Trial, flags: list[str], duration: float, mark: Path) -> bool:
    """Run the trial's command until it dies or ends; whether the trial's kill came (the kill point's mark is in
    `mark`, or the outside kill found the run still going)."""
    proc = subprocess.Popen(_command(cfg, trial, flags), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(trial, CHAOS_MARK=str(mark)))  # fmt: skip
    from_outside = False
    try:
        if trial.point == "none":
            try:
                proc.wait(timeout=trial.delay * duration)
            except subprocess.TimeoutExpired:
                from_outside = True
                _kill_tree(proc.pid)  # torchrun and its workers, as a lost node
        proc.wait(timeout=300)
    finally:
        _kill_tree(proc.pid)  # nothing of the trial may outlive it (a worker torchrun left behind, say)
        proc.wait()
    if trial.point == "none":
        return from_outside and proc.returncode != 0
    marks = mark.read_text().split("\n") if mark.exists() else []
    return f"{trial.point} {trial.count} rank {trial.rank}" in marks and proc.returncode != 0


def _val_curve(run: Path) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if k.startswith("val/")} for r in read_metrics(run / "metrics.jsonl")
            if "time/val" in r]  # fmt: skip


def _problems(run: Path, reference: Path, relaunch: subprocess.CompletedProcess[str]) -> list[str]:
    problems = []
    if relaunch.returncode != 0:
        return [f"the relaunch exited {relaunch.returncode}: {relaunch.stderr[-1500:]}"]
    if losses(run) != losses(reference):
        problems.append(f"losses differ from the uninterrupted run: {losses(run)} vs {losses(reference)}")
    if _val_curve(run) != _val_curve(reference):
        problems.append(f"validation differs: {_val_curve(run)} vs {_val_curve(reference)}")
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    if steps != list(range(STEPS + 1)):
        problems.append(f"metrics steps {steps}")
    root = run / "checkpoints"
    latest = read_latest(root)
    if latest != STEPS or not is_complete(root / step_name(STEPS)):
        problems.append(f"latest is {latest}, checkpoints {list_checkpoints(root)}")
    for folder in (root, run / "snapshots", *sorted((run / "val_arrays").glob("step_*"))):
        leftovers = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
        if leftovers:
            problems.append(f"unfinished writes left in {folder.name}: {leftovers}")
    snapshots = sorted(p.name for p in (run / "snapshots").iterdir() if p.name.startswith("step_"))
    if any(not (run / "snapshots" / s / ".metadata").is_file() for s in snapshots):
        problems.append(f"incomplete snapshots: {snapshots}")
    want = sorted(p.relative_to(reference).as_posix() for p in (reference / "val_arrays").rglob("*.npz"))
    got = sorted(p.relative_to(run).as_posix() for p in (run / "val_arrays").rglob("*.npz"))
    if got != want:
        problems.append(f"score files {got} vs {want}")
    for name in set(got) & set(want):
        with np.load(run / name) as mine, np.load(reference / name) as theirs:
            if not all(np.array_equal(mine[k], theirs[k]) for k in theirs.files):
                problems.append(f"{name} differs from the uninterrupted run's")
    return problems


def run_trial(setup: Setup, trial: Trial, tmp_path: Path) -> dict[str, object]:
    """Kill a run as `trial` says, relaunch it, and return the trial's record (`reached`, `problems`)."""
    cfg = write_config(tmp_path, "run", max_steps=STEPS)
    reached = killed_run(cfg, trial, setup.flags, setup.durations[trial.nproc], tmp_path / "mark")
    root = tmp_path / "run" / "checkpoints"
    latest_after_kill = read_latest(root) if root.is_dir() else None
    # Whatever `latest` names right after the kill must be a complete checkpoint.
    valid = latest_after_kill is None or is_complete(root / step_name(latest_after_kill))
    again = Trial(trial.index, trial.nproc, trial.async_save, "none", 0, 0, 0.0)
    relaunch = subprocess.run(_command(cfg, again, setup.flags), capture_output=True, text=True, timeout=300,
                              env=_env(trial), check=False)  # fmt: skip
    problems = ([] if valid else [f"latest {latest_after_kill} names an incomplete checkpoint after the kill"]) + (
        _problems(tmp_path / "run", setup.runs[trial.nproc], relaunch)
    )
    return {**asdict(trial), "seed": SEED, "reached": reached, "latest_after_kill": latest_after_kill,
            "problems": problems}  # fmt: skip


def verdict(results: list[dict[str, object]]) -> str | None:
    """Why a session's trials fail as a whole (None: they do not): too many kills that never came."""
    missed = [r["index"] for r in results if not r["reached"]]
    if len(missed) > MAX_NOT_REACHED * len(results):
        return (f"{len(missed)} of {len(results)} trials never reached their kill (at most {MAX_NOT_REACHED:.0%} "
                f"may): {missed}")  # fmt: skip
    return None


@pytest.mark.parametrize("index", range(TRIALS))
def test_a_killed_run_relaunched_ends_like_the_uninterrupted_one(setup: Setup, tmp_path: Path, index: int) -> None:
    record = run_trial(setup, Trial.draw(index, SEED, setup.counts), tmp_path)
    RESULTS.append(record)
    assert not record["problems"], json.dumps(record, indent=1)


def test_enough_trials_reached_their_kill() -> None:
    # Runs after the trials (pytest keeps the file's order); a selection without them has nothing to judge.
    trials = [r for r in RESULTS if int(str(r["index"])) >= 0]
    if not trials:
        pytest.skip("no trial ran in this session")
    problem = verdict(trials)
    assert problem is None, problem


def test_a_kill_that_never_comes_is_reported_not_reached(setup: Setup, tmp_path: Path) -> None:
    planted = Trial(-2, 1, False, "micro-batch", 10**6, 0, 0.0)  # far past the run's last micro-batch
    record = run_trial(setup, planted, tmp_path)
    assert record["reached"] is False and not record["problems"], record
    # Such trials fail the session once there are too many of them.
    assert verdict([record]) is not None and "1 of 1 trials never reached their kill" in str(verdict([record]))
    assert verdict([{"index": i, "reached": i != 3} for i in range(10)]) is None  # 10% may miss
    assert verdict([{"index": i, "reached": i > 1} for i in range(10)]) is not None
