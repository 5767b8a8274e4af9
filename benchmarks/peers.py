"""lmforge against the trainers a user would pick instead: torchtitan, litgpt and a hand-written loop, on the CPU.

Every side trains the same Llama (d256, 6 layers, 8 heads, 4 key/value heads, FFN 768, vocab 8192, untied head,
RoPE theta 10000) on uniform random tokens without document masking: seq_len 512, 4096 tokens per optimizer step
in one micro-batch per process (8 windows of 512 on one process, 4 per rank on two), fp32, AdamW (lr 1e-3, betas
0.9/0.95, eps 1e-8, weight decay 0.1) at a constant learning rate (no warmup, no decay), gradients clipped at 1.0:

- `lmforge` / `lmforge compiled`: the real command line, `python -m lmforge train @ run.toml` (under
  `torchrun --standalone` for 2 processes), with its defaults (`model.attn = "auto"`, `model.loss_chunk_tokens =
  "auto"`), no checkpoint, and `model.compile` off / on; step times from its `metrics.jsonl` (`perf/throughput`).
- `lmforge doc-masked` (one process): `lmforge` with document masking on, over documents of geometric length,
  `MASKED_MEAN_DOC` tokens on average; its ratio is lmforge's cost of masking.
- `plain eager` / `plain compiled`: `benchmarks/plain_loop.py` (one process): a hand-written loop, eager or with
  `torch.compile` on the whole model; step times from its own clock.
- `torchtitan` (0.3.0) and `litgpt` (0.5.13), each installed from PyPI into its own virtual environment under
  `benchmarks/.peers/<name>/` with the torch of lmforge's environment, and launched by `benchmarks/peer_shims.py`
  (which says what each needs to run on the CPU); step times from their own log lines. `torchtitan compiled` is
  torchtitan with its own `--compile.enable`; litgpt always compiles. litgpt cannot run on
  2 CPU processes (its pretraining uses Lightning's FSDP strategy for more than one device, which Lightning allows
  only on GPUs), so that side is reported as skipped.

Every side starts from the same weights and trains on the same tokens: `write_start` saves lmforge's initial
weights for the run (its own init, from `model.init`'s seed) under Hugging Face Llama names and the token windows of
every step of lmforge's run (its fake data, from `data.seed`), and the plain loop and the peers load them into their
own models and data paths (lmforge's side runs as it is: these are its weights and windows). The table checks it:
each side's first-step loss (before any update) must be within `LOSS_TOLERANCE` of lmforge's.

Every side gets the same allocator: glibc's malloc settings change a step's time by 20-28% on these cores, and
lmforge sets them for itself. The whole comparison runs once per `--allocators` setting: `lmforge` (its mmap and
trim thresholds in every side's environment, which lmforge then leaves as they are) and `default` (glibc's own,
lmforge told not to change them); the report has a table for each, and the ratios compare sides of one setting.

Each side runs `--warmup` untimed steps and then `--steps` timed ones, in its own processes, one side after the
other, after waiting (`--quiet-wait`) for the CPUs to go idle; all sides run `--repeats` times, the order reversed
at every repeat. A run's tokens/s is its timed steps' tokens over the sum of their step times; a side's is the
median over its runs, and the table gives their range too: on a shared machine two runs of one side can differ by
10%, which the best of a few runs would hide. A run during which other processes kept the CPUs busy is left out
of its side's figures (unless all were). Its peak memory is the largest peak resident set of any of its
processes (the kernel's `ru_maxrss` of the process tree: imports and compilers included), the lowest over its runs.
Threads: `--threads` for one process, split between the ranks for two. A peer that cannot be installed or fails is
reported as skipped or failed, with the reason, and the table is still printed.

    .venv/bin/python benchmarks/peers.py [--peers torchtitan,litgpt] [--procs 1,2] [--tp N] [--pp N]
                                         [--pp-schedule 1f1b|interleaved_1f1b|interleaved_zb|zbv] [--steps N]
                                         [--warmup N] [--repeats N] [--threads N] [--quiet-wait S] [--work-dir DIR]
                                         [--json PATH] [--profile DIR]

`--tp N` makes every multi-process run tensor-parallel over groups of N processes (lmforge's `parallel.tp`,
torchtitan's `--parallelism.tensor_parallel_degree`); `benchmarks/tensor_parallel.py --peers` runs it at tp 2.

`--pp N` makes every multi-process run pipeline-parallel over N stage groups with the schedule `--pp-schedule`
(default 1f1b): lmforge's `parallel.pp` and `parallel.pp_schedule`, torchtitan's
`--parallelism.pipeline_parallel_degree` and `--parallelism.pipeline_parallel_schedule` under its name for the same
schedule (`TITAN_SCHEDULES`: 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble). The data-parallel degree
becomes processes / (tp x pp), and the ranks of a pipeline train on the same windows. A step is one micro-batch per
window on both sides (lmforge's `data.micro_batch_tokens = seq_len`; torchtitan's `local_batch_size` = the rank's
windows and `--parallelism.pipeline_parallel_microbatch_size 1`): 8 micro-batches at dp 1. Both cut the 6 layers
alike (`Settings.stage_layers`, torchtitan's default cut, which counts the embedding and the head as one layer each:
[3, 3] for 1f1b at pp 2, [1, 2, 2, 1] for two stages per rank), set as lmforge's `parallel.pp_layers` and
torchtitan's `module_fqns_per_model_part`. Under PP only torchtitan's ranks holding the last stage log the loss
(the others log -1), so its output is read from every rank and the step lines with a loss kept (their tps is the
last stage's rank's). `benchmarks/pipeline_parallel.py --peers` runs it at pp 2 with 1f1b.

`--merge A.json B.json ...` runs nothing and prints the table over all the runs that earlier invocations wrote with
`--json` (the same settings), for a median over more runs than one invocation makes.

`--profile DIR` runs every side once more after the timed runs, with `torch.profiler` on rank 0 over
`PROFILE_STEPS` steps after the warmup, and writes each side's table of top operators (by time spent in the
operator itself) to `DIR/<side>-<processes>.txt`; those runs do not count in the figures.
    .venv/bin/python benchmarks/peers.py --smoke    # tiny model, 2 steps, lmforge and plain eager only (~40 s)

The full run takes about 17 minutes on 2 idle cores (more when torch's compile cache is cold), plus about 3 minutes
to install the peers the first time.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

import common
from cpu_load import cpu_busy_s, settle
from lmforge.config import TrainConfig
from lmforge.config.loader import dump_toml
from lmforge.data.fake import fake_window
from lmforge.hf.names import export_tensors
from lmforge.model import build_model
from lmforge.model.init import init_weights

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE / ".peers"
"""Where the peers' virtual environments live (git-ignored)."""
SHIMS = HERE / "peer_shims.py"
PLAIN_LOOP = HERE / "plain_loop.py"
PEER_PACKAGES = {"torchtitan": ["torchtitan==0.3.0"], "litgpt": ["litgpt==0.5.13", "requests"]}
"""What each peer's environment gets besides torch (litgpt imports `requests` without requiring it)."""
UNSUPPORTED = {
    ("litgpt", 2): "litgpt pretrain trains 2+ devices with Lightning's FSDP strategy, which is GPU-only "
    "(ValueError: FSDP is only available on GPU)",
}
"""Sides that cannot run on this machine, and why (found by trying)."""
SMOKE_SKIP = "--smoke does not install peers"
SMOKE_NO_COMPILE = "skipped: --smoke does not compile (overhead.py --smoke runs the compiled loop)"
INSTALL_TIMEOUT_S = 1800.0
MASKED_MEAN_DOC = 256
"""Mean document length of the `lmforge doc-masked` side (geometric lengths)."""
PROFILE_STEPS = 4
"""Steps each side profiles with `--profile`."""
FOREIGN_LIMIT = 0.1
"""Cores of foreign load above which a side's figure is flagged."""
LOSS_TOLERANCE = 1e-4
"""How far a side's first-step loss may be from lmforge's: every side starts from the same weights and windows. Sides
agree to a few 1e-6; queries and keys in the wrong RoPE layout move the first loss by only 2-4e-4, so the bound is
tighter than that."""
OTHER_ATTENTION = ("lmforge doc-masked",)
"""Sides whose first loss is not compared with lmforge's: document masking changes what each token attends to."""


@dataclass(frozen=True)
class Settings:
    """The model, the batch, the optimizer and the step counts every side shares."""

    hidden_size: int = 256
    intermediate_size: int = 768
    """torchtitan's SwiGLU width for d256: 8/3 x 256 rounded up to a multiple of 256."""
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 8192
    seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    batch_tokens: int = 4096
    """Tokens per optimizer step over all processes, one micro-batch per process."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_norm: float = 1.0
    init_std: float = 0.02
    seed: int = 0
    warmup: int = 3
    """Untimed steps first (compilation, allocator warm-up)."""
    steps: int = 10
    """Timed steps per side."""
    repeats: int = 4
    """Runs per side, in alternating order; the median counts."""
    threads: int = 2
    timeout_s: float = 900.0
    """Longest a side may run, startup and compilation included."""
    allocator: str = "lmforge"
    """The allocator setting every side runs with (`common.ALLOCATORS`)."""
    tp: int = 1
    """Tensor-parallel degree of every run on more than one process (lmforge's `parallel.tp`, torchtitan's
    `--parallelism.tensor_parallel_degree`); its ranks train on the same windows."""
    pp: int = 1
    """Pipeline-parallel degree of every run on more than one process (lmforge's `parallel.pp`, torchtitan's
    `--parallelism.pipeline_parallel_degree`); the ranks of a pipeline train on the same windows, one window per
    micro-batch."""
    pp_schedule: str = "1f1b"
    """lmforge's name of the pipeline schedule (`parallel.pp_schedule`; torchtitan's name in `TITAN_SCHEDULES`)."""

    def data_ranks(self, procs: int) -> int:
        """Data-parallel ranks of a run on `procs` processes: the ranks of a TP group and of a pipeline train on
        the same windows."""
        return procs // (self.tp * self.pp) if procs > 1 else 1

    def rows(self, procs: int) -> int:
        """Windows per data-parallel rank and step."""
        return self.batch_tokens // self.seq_len // self.data_ranks(procs)

    def pipelined(self, procs: int) -> bool:
        """Whether a run on `procs` processes is pipeline-parallel."""
        return procs > 1 and self.pp > 1

    def stage_layers(self) -> list[int]:
        """Decoder layers per pipeline stage, first stage first: torchtitan's default cut
        (`_generate_llm_fqn_per_model_part`), which counts the embedding as one more layer of the first stage and
        the final norm with the LM head as one more of the last, and spreads the total evenly (the first stages
        take the remainder); both sides get it (lmforge's `parallel.pp_layers`, torchtitan's
        `module_fqns_per_model_part`). One stage per rank for 1f1b, two for the others."""
        stages = self.pp * (1 if self.pp_schedule == "1f1b" else 2)
        total = self.num_layers + 2
        each, extra = divmod(total, stages)
        layers = [each + (i < extra) for i in range(stages)]
        layers[0] -= 1
        layers[-1] -= 1
        return layers

    def peer_spec(self, procs: int, out_dir: Path, start: Start) -> dict[str, Any]:
        """What `peer_shims.py` reads from `PEER_SPEC`."""
        steps = self.warmup + self.steps
        return {
            **asdict(self),
            "procs": procs,
            "local_batch": self.rows(procs),
            "pp_layers": self.stage_layers() if self.pipelined(procs) else None,
            "steps": steps,
            "out_dir": str(out_dir),
            "weights": str(start.weights),
            "windows": str(start.windows),
        }


SMOKE = Settings(
    hidden_size=64,
    intermediate_size=176,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=512,
    seq_len=128,
    batch_tokens=256,
    warmup=1,
    steps=2,
    repeats=1,
    timeout_s=240.0,
)
"""A tiny model: checks that the script runs, not a figure."""


# ---------------------------------------------------------------------------------------------- running a side


@dataclass
class Run:
    """What one side's run gave: its status, per-step throughput and the process tree's resources."""

    side: str
    procs: int
    allocator: str = "lmforge"
    """The allocator setting of the run (`common.ALLOCATORS`)."""
    status: str = "ok"
    """ok, skipped or failed."""
    reason: str = ""
    step_tokens_per_s: list[float] = field(default_factory=list)
    """Every step's throughput, warmup included, over all processes."""
    tokens_per_s: float = math.nan
    tokens_per_s_range: tuple[float, float] = (math.nan, math.nan)
    """Over a side's repeats (`side_figures`): its slowest and fastest run."""
    peak_rss_mib: float = math.nan
    """Largest peak resident set of any process of the run."""
    params: int | None = None
    """Parameters of the model the side built, as it reports them: every side must build the same model."""
    first_loss: float = math.nan
    """The loss of the first step (before any update), as the side logs it: it depends on the side's own init."""
    wall_s: float = math.nan
    foreign_cores: float = math.nan
    """Mean cores other processes kept busy over the whole run."""
    command: list[str] = field(default_factory=list)


@dataclass
class Finished:
    """A command's exit: its code (None: killed at the timeout), resources and log."""

    returncode: int | None
    wall_s: float
    peak_rss_mib: float
    cpu_s: float
    busy_s: float
    log: str


def run_command(cmd: Sequence[str], env: dict[str, str], cwd: Path, log: Path, timeout_s: float) -> Finished:
    """Run `cmd` in a session of its own, output to `log`; kill the whole session after `timeout_s`.

    `wait4` gives the resources of the process and of every descendant it waited for (torchrun waits for its
    workers): `ru_maxrss` is the largest peak resident set among them, the CPU times are their sum.
    """
    busy0, t0 = cpu_busy_s(), time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = t0 + timeout_s
    status, usage, returncode = 0, None, None
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                _kill_session(proc.pid)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    except BaseException:
        _kill_session(proc.pid)  # Ctrl-C: no orphaned trainers on the CPUs
        raise
    finally:
        proc.returncode = returncode if returncode is not None else -1  # reaped here; Popen must not wait again
    wall = time.monotonic() - t0
    busy = cpu_busy_s() - busy0
    assert usage is not None
    cpu = usage.ru_utime + usage.ru_stime
    text = log.read_text(encoding="utf-8", errors="replace")
    return Finished(returncode, wall, usage.ru_maxrss / 1024, cpu, busy, text)


def _descendants(root: int) -> list[int]:
    """The process ids below `root` (children, grandchildren, ...), from /proc; empty off Linux."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The parent id is the second field after the command name, which may itself hold spaces.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_session(pid: int) -> None:
    """End a run: SIGTERM to its session (torchrun forwards it to its workers), then SIGKILL, 10 s on, to the session
    and to every process it started. torchrun starts each worker in a session of its own, so the workers are
    found, before the SIGTERM, by walking the process tree down from the run's first process."""
    below = _descendants(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    for _ in range(50):
        time.sleep(0.2)
        alive = [p for p in [pid, *below] if _alive(p)]
        if not alive:
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def last_error(log: str) -> str:
    """The line of a log that says best why a run failed: the last exception line, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(Error|Exception|error:)", line) and "Traceback" not in line]
    return (errors or lines or ["no output"])[-1][:300]


def measure(
    side: str,
    procs: int,
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    settings: Settings,
    parse: Callable[[str], Logged],
) -> Run:
    """Run one side's command and turn what it logged (per-step throughput, parameters, first loss) into the side's
    figures."""
    run = Run(side, procs, settings.allocator, command=cmd)
    finished = run_command(cmd, env, cwd, cwd / "log.txt", settings.timeout_s)
    run.wall_s, run.peak_rss_mib = finished.wall_s, finished.peak_rss_mib
    run.foreign_cores = max(finished.busy_s - finished.cpu_s, 0.0) / finished.wall_s
    if finished.returncode is None:
        return replace(run, status="failed", reason=f"timed out after {settings.timeout_s:.0f} s")
    if finished.returncode != 0:
        return replace(run, status="failed", reason=f"exit {finished.returncode}: {last_error(finished.log)}")
    try:
        run.step_tokens_per_s, run.params, run.first_loss = parse(finished.log)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return replace(run, status="failed", reason=f"could not read its step times: {e}")
    timed = run.step_tokens_per_s[settings.warmup : settings.warmup + settings.steps]
    if len(timed) < settings.steps:
        return replace(run, status="failed", reason=f"logged {len(run.step_tokens_per_s)} steps")
    # Total tokens over total time: each step's seconds are its tokens over its throughput.
    run.tokens_per_s = len(timed) * settings.batch_tokens / sum(settings.batch_tokens / t for t in timed)
    return run


Logged = tuple[list[float], int | None, float]
"""What a side's output gives: every step's tokens/s, the parameter count and the first step's loss."""


def child_env(
    settings: Settings, procs: int, spec: dict[str, Any] | None = None, profile: Path | None = None
) -> dict[str, str]:
    """The environment of a side: this one, with the threads per process and the run's allocator setting; for a
    peer, with its `PEER_SPEC` and
    without `PYTHONPATH` (the peer's interpreter must see its own packages only); with `profile`, the request for
    a profile written there (`peer_shims.profile_from_env`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, settings.threads // procs))}
    for name in {n for setting in common.ALLOCATORS.values() for n in setting}:
        env.pop(name, None)  # this process's own setting must not leak into a side's
    env.update(common.ALLOCATORS[settings.allocator])
    if profile is not None:
        env["PEER_PROFILE"] = f"{profile}:{settings.warmup}:{min(PROFILE_STEPS, settings.steps)}"
    if spec is not None:
        env["PEER_SPEC"] = json.dumps(spec)
        env.pop("PYTHONPATH", None)
    return env


def torchrun(python: str, procs: int, every_rank: bool = False) -> list[str]:
    """The torchrun launcher of an interpreter: a free rendezvous port, rank 0's output only (prefixed), or with
    `every_rank` every rank's."""
    ranks = ",".join(map(str, range(procs))) if every_rank else "0"
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
            "--tee=3", f"--local-ranks-filter={ranks}", "--role=rank"]  # fmt: skip


# ---------------------------------------------------------------------------------------------- the sides


def lmforge_config(
    settings: Settings, procs: int, out_dir: Path, compiled: bool = False, masked: bool = False
) -> TrainConfig:
    """The run's lmforge config: fake data of uniform tokens, one window per segment (no document masking), one
    micro-batch per rank, a constant learning rate, no checkpoint; `compiled` turns `model.compile` on, `masked`
    document masking on (documents of `MASKED_MEAN_DOC` tokens on average)."""
    s = settings
    return TrainConfig.model_validate(
        {
            "max_steps": s.warmup + s.steps,
            "output_dir": str(out_dir / "run"),
            "model": {
                "arch": {
                    "model_type": "llama",
                    "hidden_size": s.hidden_size,
                    "intermediate_size": s.intermediate_size,
                    "num_hidden_layers": s.num_layers,
                    "num_attention_heads": s.num_heads,
                    "num_key_value_heads": s.num_kv_heads,
                    "max_position_embeddings": s.seq_len,
                    "rope_theta": s.rope_theta,
                    "rms_norm_eps": s.norm_eps,
                },
                "init": {"std": s.init_std, "seed": s.seed},
                "param_dtype": "float32",
                "compile": compiled,
            },
            "data": {
                "type": "fake",
                "seq_len": s.seq_len,
                "batch_tokens": s.batch_tokens,
                # A pipeline needs micro-batches: one window each.
                "micro_batch_tokens": s.seq_len if s.pipelined(procs) else s.batch_tokens // s.data_ranks(procs),
                "vocab_size": s.vocab_size,
                "pattern": "uniform",
                "document_masking": masked,
                "mean_doc_len": MASKED_MEAN_DOC,
                "seed": s.seed,
            },
            "optim": {
                "type": "adamw",
                "lr": s.lr,
                "weight_decay": s.weight_decay,
                "beta1": s.beta1,
                "beta2": s.beta2,
                "eps": s.eps,
                "max_norm": s.max_norm,
            },
            "schedule": {"warmup": 0.0, "decay": 0.0},
            "ckpt": {"final": False},
            "log": {"interval": 1},
            "parallel": {"tp": s.tp if procs > 1 else 1}
            | ({"pp": s.pp, "pp_schedule": s.pp_schedule, "pp_layers": s.stage_layers()} if s.pipelined(procs) else {}),
        }
    )


@dataclass(frozen=True)
class Start:
    """What every side starts from: lmforge's initial weights and the token windows of lmforge's steps."""

    weights: Path
    """safetensors, Hugging Face Llama tensor names, fp32."""
    windows: Path
    """.npy, int64 [steps x windows per step, seq_len + 1]: step k trains on rows k x W .. (k + 1) x W - 1, rank r of
    P on the r-th P-th of them (lmforge's layout: ranks take contiguous slices of the step's windows)."""


def write_start(settings: Settings, folder: Path) -> Start:
    """Write the weights lmforge's side starts from and the windows it trains on, computed by lmforge's own code
    from the config of that side (`lmforge_config`), for the other sides to load.

    lmforge's side itself runs unchanged: its from-scratch init depends only on `model.init` (seed, std) and the
    parameter names, not on the world size, and its fake windows only on `data.seed` and the window's index, so
    these are the weights and windows it trains on, on one process or two (the first-loss check confirms it)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = lmforge_config(settings, 1, folder)
    arch, init, data = config.model.arch, config.model.init, config.data
    assert arch is not None and init.scheme == "normal" and data.type == "fake", "the benchmark's config changed"
    model = build_model(arch, data.vocab_size, "sdpa", torch.device("cpu"))
    init_weights(model, init.std, init.seed, init.truncate)
    start = Start(folder / "weights.safetensors", folder / "windows.npy")
    save_file({name: t.contiguous() for name, t in export_tensors(model).items()}, start.weights)
    count = (settings.warmup + settings.steps) * (settings.batch_tokens // settings.seq_len)
    np.save(start.windows, np.stack([fake_window(data, i).tokens for i in range(count)]).astype(np.int64))
    return start


def run_lmforge(
    settings: Settings, procs: int, work: Path, profile: Path | None, compiled: bool = False, masked: bool = False
) -> Run:
    """lmforge's command line, alone or under torchrun (through `peer_shims.py run` when profiled)."""
    config = lmforge_config(settings, procs, work, compiled, masked)
    path = work / "run.toml"
    path.write_text(dump_toml(config), encoding="utf-8")
    launcher = [sys.executable] if procs == 1 else torchrun(sys.executable, procs)
    module = ["-m", "lmforge"] if profile is None else [str(SHIMS), "run", "-m", "lmforge"]
    cmd = [*launcher, *module, "train", "@", str(path)]

    def parse(_: str) -> Logged:
        lines = (work / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        records = list(map(json.loads, filter(None, lines)))
        # Step records carry perf/throughput; the record of step 0 holds the parameter counts.
        steps = sorted((r for r in records if "perf/throughput" in r), key=lambda r: r["step"])
        params = next(int(r["params/total"]) for r in records if r["step"] == 0)
        return [float(r["perf/throughput"]) for r in steps], params, float(steps[0]["loss/mean"])

    side = "lmforge compiled" if compiled else "lmforge doc-masked" if masked else "lmforge"
    return measure(side, procs, cmd, child_env(settings, procs, profile=profile), work, settings, parse)


def run_plain(settings: Settings, compiled: bool, start: Start, work: Path, profile: Path | None = None) -> Run:
    """The hand-written loop of `plain_loop.py`, one process (through `peer_shims.py run` when profiled), from the
    weights and on the windows of `start`."""
    s = settings
    shape = {"hidden-size": s.hidden_size, "intermediate-size": s.intermediate_size, "num-layers": s.num_layers,
             "num-heads": s.num_heads, "num-kv-heads": s.num_kv_heads, "vocab-size": s.vocab_size,
             "max-seq-len": s.seq_len, "rope-theta": s.rope_theta, "norm-eps": s.norm_eps, "lr": s.lr,
             "weight-decay": s.weight_decay, "beta1": s.beta1, "beta2": s.beta2, "eps": s.eps,
             "max-norm": s.max_norm}  # fmt: skip
    out = work / "steps.json"
    cmd = [sys.executable, *([] if profile is None else [str(SHIMS), "run"]), str(PLAIN_LOOP)]
    cmd += [f"--{k}={v}" for k, v in shape.items()]
    cmd += [f"--batch={s.rows(1)}", f"--steps={s.warmup + s.steps}", f"--seed={s.seed}", f"--json={out}"]
    cmd += [f"--init={start.weights}", f"--windows={start.windows}"]
    cmd += ["--compile"] if compiled else []

    def parse(_: str) -> Logged:
        figures = json.loads(out.read_text())
        speeds = [figures["tokens_per_step"] / sec for sec in figures["step_seconds"]]
        return speeds, int(figures["params"]), float(figures["losses"][0])

    side = "plain compiled" if compiled else "plain eager"
    return measure(side, 1, cmd, child_env(settings, 1, profile=profile), work, settings, parse)


TITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "interleaved_zb": "InterleavedZeroBubble",
                   "zbv": "ZBVZeroBubble"}  # fmt: skip
"""torchtitan's names (`--parallelism.pipeline_parallel_schedule`, torch's schedule classes) of lmforge's pipeline
schedules."""
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?tps:\s*([\d,]+)")
TITAN_PARAMS = re.compile(r"size: ([\d,]+) total parameters")
LITGPT_STEP = re.compile(r"iter (\d+) step \d+ \| loss train: ([\d.]+).*?iter time: ([\d.]+) ms")
LITGPT_PARAMS = re.compile(r"Total parameters: ([\d,]+)")


def run_torchtitan(
    settings: Settings,
    procs: int,
    python: str,
    start: Start,
    work: Path,
    profile: Path | None = None,
    compiled: bool = False,
) -> Run:
    """torchtitan's trainer under torchrun (it reads its ranks from torchrun's environment even for one); with
    `compiled`, its own `--compile.enable` (each transformer block and the loss under `torch.compile`). The shim
    loads the weights of `start` after torchtitan's own init and feeds the windows of `start`."""
    piped = settings.pipelined(procs)
    # Under PP only the ranks holding the last stage know the loss (the others log -1), and which rank that is
    # depends on the schedule (rank 0 for zbv's V): keep every rank's output.
    cmd = [*torchrun(python, procs, every_rank=piped), str(SHIMS), "torchtitan"]
    # With torch 2.13, torchtitan's default SPMD backend (spmd_types) rejects the FSDP mesh on more than one rank.
    cmd += ["--parallelism.spmd_backend", "full_dtensor"] if procs > 1 else []
    cmd += ["--compile.enable"] if compiled else []
    cmd += ["--parallelism.tensor_parallel_degree", str(settings.tp)] if procs > 1 and settings.tp > 1 else []
    if piped:
        # Micro-batches of one window each, `local_batch` (the data-parallel rank's windows of a step) of them;
        # the cut into stages is `Settings.stage_layers`, which the shim gives torchtitan.
        cmd += ["--parallelism.pipeline_parallel_degree", str(settings.pp),
                "--parallelism.pipeline_parallel_schedule", TITAN_SCHEDULES[settings.pp_schedule],
                "--parallelism.pipeline_parallel_microbatch_size", "1"]  # fmt: skip
    env = child_env(settings, procs, settings.peer_spec(procs, work / "out", start), profile)

    def parse(log: str) -> Logged:
        # `tps` is tokens per second per device (a data-parallel rank's, over its TP x PP degree), over the step
        # since the previous log line. On more than one rank (`full_dtensor`) the logged loss is the global mean
        # times the data-parallel ranks: the loss is a DTensor that already holds the global mean on every rank,
        # and the logging sums its local values over them. Under PP, the ranks without the last stage log a loss
        # of -1, which TITAN_STEP does not match: the step's figures come from the last stage's rank (every rank
        # measures the same step).
        steps = {int(m[1]): (float(m[3].replace(",", "")) * procs, float(m[2])) for m in TITAN_STEP.finditer(log)}
        params = TITAN_PARAMS.search(log)
        return ([steps[i][0] for i in sorted(steps)], int(params[1].replace(",", "")) if params else None,
                steps[min(steps)][1] / settings.data_ranks(procs))  # fmt: skip

    return measure("torchtitan compiled" if compiled else "torchtitan", procs, cmd, env, work, settings, parse)


def run_litgpt(
    settings: Settings, procs: int, python: str, start: Start, work: Path, profile: Path | None = None
) -> Run:
    """litgpt's `pretrain` through its Python API (one process), from the weights of `start` (its own
    `initial_checkpoint_dir`) and on its windows."""
    cmd = [python, str(SHIMS), "litgpt"]
    env = child_env(settings, procs, settings.peer_spec(procs, work / "out", start), profile)
    tokens = settings.batch_tokens

    def parse(log: str) -> Logged:
        # `iter time`: from after the batch is fetched to after the loss is read back, per iteration (= step).
        steps = {int(m[1]): (tokens / (float(m[3]) / 1000), float(m[2])) for m in LITGPT_STEP.finditer(log)}
        params = LITGPT_PARAMS.search(log)
        # The log line rounds the loss to 3 decimals; its CSV logger keeps every digit.
        first = litgpt_first_loss(work / "out") if steps else math.nan
        return ([steps[i][0] for i in sorted(steps)], int(params[1].replace(",", "")) if params else None,
                first if math.isfinite(first) else steps[min(steps)][1])  # fmt: skip

    return measure("litgpt", procs, cmd, env, work, settings, parse)


def litgpt_first_loss(out_dir: Path) -> float:
    """The first iteration's training loss in litgpt's CSV log (`logs/csv/version_*/metrics.csv` under its out
    dir), NaN if there is none."""
    for path in sorted(out_dir.glob("logs/csv/*/metrics.csv")):
        with path.open(encoding="utf-8") as f:
            for record in csv.DictReader(f):
                if record.get("iter") and float(record["iter"]) == 1 and record.get("loss"):
                    return float(record["loss"])
    return math.nan


# ---------------------------------------------------------------------------------------------- installing peers


def peer_python(name: str) -> Path:
    """The interpreter of a peer's environment."""
    return PEERS_DIR / name / "bin" / "python"


def install_peer(name: str, console: Any) -> str | None:
    """Make sure the peer's environment holds its pinned packages with lmforge's torch; None when it does, else
    why not. pip gets `torch==<this torch's version>`, local label included (`+cpu`), in the same command, so it
    can neither replace it with another build nor pull a CUDA one."""
    venv = PEERS_DIR / name
    wanted = [f"torch=={torch.__version__}", *PEER_PACKAGES[name]]
    marker = venv / "lmforge-peer.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(marker.read_text()) == wanted and peer_python(name).exists():
            return None
    console.print(f"installing {name} into {venv}: {' '.join(wanted)}", highlight=False)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{name}-install.log"
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(peer_python(name)), "-m", "pip", "install", "--progress-bar=off", *wanted],
    ]
    for cmd in steps:
        finished = run_command(cmd, dict(os.environ), venv.parent, log, INSTALL_TIMEOUT_S)
        if finished.returncode != 0:
            why = "timed out" if finished.returncode is None else last_error(finished.log)
            return f"install failed ({' '.join(cmd[2:4])}): {why}"
    marker.write_text(json.dumps(wanted), encoding="utf-8")
    return None


# ---------------------------------------------------------------------------------------------- report


def summarize(runs: list[Run], settings: Settings) -> dict[str, Any]:
    """The runs, and lmforge's throughput (eager and compiled) and memory over each side's at the same process
    count and allocator setting."""
    lmforge = {(r.allocator, r.procs): r for r in runs if r.side == "lmforge" and r.status == "ok"}
    compiled = {(r.allocator, r.procs): r for r in runs if r.side == "lmforge compiled" and r.status == "ok"}
    rows = []
    for r in runs:
        row: dict[str, Any] = asdict(r)
        base, fast = lmforge.get((r.allocator, r.procs)), compiled.get((r.allocator, r.procs))
        ok = r.status == "ok"
        row["lmforge_over_side"] = base.tokens_per_s / r.tokens_per_s if ok and base else None
        row["lmforge_compiled_over_side"] = fast.tokens_per_s / r.tokens_per_s if ok and fast else None
        row["lmforge_over_side_memory"] = base.peak_rss_mib / r.peak_rss_mib if ok and base else None
        # Every side must build the same model: its own count of parameters equals lmforge's.
        row["same_params"] = (r.params == base.params) if ok and base and r.params is not None else None
        # ... and start from the same weights on the same windows: its first loss within LOSS_TOLERANCE of lmforge's.
        compared = ok and base is not None and r.side not in OTHER_ATTENTION
        row["first_loss_diff"] = abs(r.first_loss - base.first_loss) if compared and base else None
        row["same_first_loss"] = (row["first_loss_diff"] <= LOSS_TOLERANCE) if compared else None
        rows.append(row)
    return {"settings": asdict(settings), "torch": torch.__version__, "sides": rows}


def _ratio(value: float | None, itself: bool) -> str:
    """A ratio cell: empty on the row it is measured from, `-` where a side did not run."""
    return "" if itself else (f"{value:.2f}x" if value is not None else "-")


def print_report(summary: dict[str, Any], console: Any) -> None:
    """A table per allocator setting: each side's tokens/s and peak memory, and lmforge's ratios to it."""
    for allocator in dict.fromkeys(row["allocator"] for row in summary["sides"]):
        _print_table(summary, allocator, console)
    console.print(
        "tokens/s: timed steps' tokens over the sum of their step times, as each side logs them, the median of the "
        "side's runs (range: its slowest and fastest); peak RSS: the "
        "largest peak resident set of any process of the side (imports and compilers included); lmforge / side: "
        "lmforge (eager, or compiled) at the same number of processes and allocator setting over the side (above 1: "
        "lmforge is faster, or uses more memory); parameters: as the side counts them, which must equal lmforge's "
        f"(the same model); first loss: the first step's, before any update, which must be within {LOSS_TOLERANCE:g} "
        "of lmforge's at the same number of processes (every side starts from lmforge's initial weights and trains "
        "on lmforge's token windows; doc-masked attends within documents, so its loss is not compared)."
    )
    if any(row["status"] == "ok" and row["foreign_cores"] > FOREIGN_LIMIT for row in summary["sides"]):
        console.print(
            f"[yellow]other processes used the CPUs during some runs (> {FOREIGN_LIMIT} cores): those figures are "
            "not reliable; rerun on an idle machine[/]"
        )


def _print_table(summary: dict[str, Any], allocator: str, console: Any) -> None:
    """The table of one allocator setting."""
    s = Settings(**summary["settings"])
    title = (
        f"lmforge vs the alternatives: Llama d{s.hidden_size} x{s.num_layers}, {s.num_heads} heads "
        f"({s.num_kv_heads} KV), vocab {s.vocab_size}, seq {s.seq_len}, {s.batch_tokens} tokens/step, fp32, "
        f"{s.steps} timed steps after {s.warmup}; {common.ALLOCATOR_LABELS[allocator]}"
        + (f"; the multi-process runs are tensor-parallel (tp {s.tp})" if s.tp > 1 else "")
        + (
            f"; the multi-process runs are pipeline-parallel (pp {s.pp}, {s.pp_schedule}, stages of "
            f"{s.stage_layers()} layers, micro-batches of one window)"
            if s.pp > 1
            else ""
        )
    )
    columns = ["side", "processes", "tokens/s\n(median)", "range", "peak RSS MiB\n(largest process)",
               "lmforge / side\ntokens/s", "lmforge compiled\n/ side tokens/s", "lmforge / side\npeak memory",
               "parameters", "first\nloss", "notes"]  # fmt: skip
    table = common.result_table(title, columns, left={"side", "notes"})
    for row in (r for r in summary["sides"] if r["allocator"] == allocator):
        if row["status"] != "ok":
            missing = ["-"] * 8
            table.add_row(row["side"], str(row["procs"]), *missing, f"{row['status']}: {row['reason']}")
            continue
        notes = [f"other processes: {row['foreign_cores']:.2f} cores"] if row["foreign_cores"] > FOREIGN_LIMIT else []
        notes += ["NOT THE SAME MODEL: its parameter count differs from lmforge's"] * (row["same_params"] is False)
        if row.get("same_first_loss") is False:
            notes.append(f"NOT THE SAME START: its first loss is {row['first_loss_diff']:.2g} from lmforge's")
        params = f"{row['params']:,}" if row["params"] is not None else "-"
        table.add_row(
            row["side"],
            str(row["procs"]),
            f"{row['tokens_per_s']:,.0f}",
            "{:,.0f}-{:,.0f}".format(*row["tokens_per_s_range"]),
            f"{row['peak_rss_mib']:,.0f}",
            _ratio(row["lmforge_over_side"], row["side"] == "lmforge"),
            _ratio(row["lmforge_compiled_over_side"], row["side"] == "lmforge compiled"),
            _ratio(row["lmforge_over_side_memory"], row["side"] == "lmforge"),
            params,
            f"{row['first_loss']:.4f}",
            "; ".join(notes),
        )
    console.print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    smoke = f"tiny model and {SMOKE.steps} steps, lmforge and the eager plain loop only: checks the script runs (~40 s)"
    presets = {"default": Settings(), "smoke": SMOKE}
    p = common.benchmark_parser(__doc__, presets, smoke, quiet_wait="before each run", all_cores=True)
    p.add_argument("--peers", default="torchtitan,litgpt", help="peers to run, comma-separated (default: both)")
    p.add_argument("--procs", default="1,2", help="process counts, comma-separated (default 1,2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the multi-process runs (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the multi-process runs (default 1)")
    p.add_argument(
        "--pp-schedule", default="1f1b", choices=list(TITAN_SCHEDULES),
        help="pipeline schedule with --pp (lmforge's names; torchtitan gets its own name for the same schedule)",
    )  # fmt: skip
    p.add_argument(
        "--allocators", default=",".join(common.ALLOCATORS),
        help="allocator settings every side runs with in turn: lmforge (its malloc thresholds), default (glibc's)",
    )  # fmt: skip
    p.add_argument(
        "--work-dir", type=Path, default=None, help="keep each run's config, output and log here (default: a temp dir)"
    )
    p.add_argument(
        "--profile", type=Path, default=None, help="after the timed runs, profile each side once; tables to this folder"
    )
    p.add_argument(
        "--merge", type=Path, nargs="+", default=None, metavar="JSON",
        help="run nothing: print the table over all the runs in these --json files of earlier invocations",
    )  # fmt: skip
    return p.parse_args(argv)


Key = tuple[str, str, int]
"""(allocator setting, side, processes)."""


def merge_runs(paths: list[Path]) -> tuple[list[Key], dict[Key, list[Run]]]:
    """The sides (in their first file's order) and every run of each, from the `--json` files of invocations of
    this script with the same settings."""
    order: list[Key] = []
    runs: dict[Key, list[Run]] = {}
    for path in paths:
        for record in json.loads(path.read_text(encoding="utf-8"))["runs"]:
            record["tokens_per_s_range"] = tuple(record.get("tokens_per_s_range", (math.nan, math.nan)))
            run = Run(**record)
            key = (run.allocator, run.side, run.procs)
            if key not in runs:
                order.append(key)
            runs.setdefault(key, []).append(run)
    return order, runs


Job = Callable[[Path, Path | None], Run] | str
"""How a side runs: a function of its work folder and profile path (None: no profile), or the line saying why it
does not."""


def plan_sides(settings: Settings, procs: list[int], peers: list[str], smoke: bool, pythons: dict[str, str],
               reasons: dict[str, str], start: Start) -> list[tuple[str, int, Job]]:  # fmt: skip
    """Every (side, processes) of the run and its job, in running order; the plain loop and the peers start from
    the weights and train on the windows of `start`."""
    # --smoke leaves compilation out: it alone would take most of the check's time.
    no_compile = SMOKE_NO_COMPILE if smoke else None
    plan: list[tuple[str, int, Job]] = []
    for n in procs:
        plan.append(("lmforge", n, lambda w, p, n=n: run_lmforge(settings, n, w, p)))
        compiled = no_compile or (lambda w, p, n=n: run_lmforge(settings, n, w, p, compiled=True))
        plan.append(("lmforge compiled", n, compiled))
        if n == 1:
            plan.append(("lmforge doc-masked", 1, lambda w, p: run_lmforge(settings, 1, w, p, masked=True)))
            plan.append(("plain eager", 1, lambda w, p: run_plain(settings, False, start, w, p)))
            plan.append(("plain compiled", 1, no_compile or (lambda w, p: run_plain(settings, True, start, w, p))))
        for name in peers:
            if (name, n) in UNSUPPORTED:
                plan.append((name, n, f"skipped: {UNSUPPORTED[name, n]}"))
            elif name in reasons:
                plan.append((name, n, f"skipped: {reasons[name]}"))
            else:
                runner = run_torchtitan if name == "torchtitan" else run_litgpt
                plan.append((name, n, lambda w, p, n=n, f=runner, py=pythons[name]: f(settings, n, py, start, w, p)))
                if name == "torchtitan":
                    titan_compiled = no_compile or (
                        lambda w, p, n=n, py=pythons[name]: run_torchtitan(settings, n, py, start, w, p, compiled=True)
                    )
                    plan.append(("torchtitan compiled", n, titan_compiled))
    return plan


def side_figures(runs: list[Run]) -> Run:
    """A side's figures over its repeats: the median run's tokens/s (with the lowest and highest), the lowest peak
    memory; if none ran, the last failure. Runs during which other processes kept more than `FOREIGN_LIMIT` cores
    busy count only when every run of the side did (the table then flags the figure)."""
    ok = [r for r in runs if r.status == "ok"]
    if not ok:
        return runs[-1]
    ok = [r for r in ok if r.foreign_cores <= FOREIGN_LIMIT] or ok
    speeds = [r.tokens_per_s for r in ok]
    middle = sorted(ok, key=lambda r: r.tokens_per_s)[(len(ok) - 1) // 2]
    return replace(
        middle,
        tokens_per_s=statistics.median(speeds),
        tokens_per_s_range=(min(speeds), max(speeds)),
        peak_rss_mib=min(r.peak_rss_mib for r in ok),
    )


def profile_sides(plan: list[tuple[str, int, Job]], work_root: Path, out: Path, quiet: float, console: Any) -> None:
    """Run every side once more with a profile, written to `out/<side>-<processes>.txt`."""
    out.mkdir(parents=True, exist_ok=True)
    for side, n, job in plan:
        if isinstance(job, str):
            continue
        name = f"{side.replace(' ', '-')}-{n}"
        work = work_root / f"{name}-profile"
        work.mkdir(parents=True, exist_ok=True)
        settle(quiet)
        run = job(work, (out / f"{name}.txt").resolve())
        done = (out / f"{name}.txt").is_file()
        figure = "written" if done else f"missing ({run.status}: {run.reason or 'no table written'})"
        console.print(f"profile {side} x{n}: {out / (name + '.txt')} {figure}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    """Install the peers, run every side, print the table; 0 unless lmforge or the plain loop failed."""
    args = parse_args(argv)
    settings = replace(common.with_flags(SMOKE if args.smoke else Settings(), args), tp=args.tp, pp=args.pp,
                       pp_schedule=args.pp_schedule)  # fmt: skip
    if args.merge:
        settings = Settings(**json.loads(args.merge[0].read_text(encoding="utf-8"))["settings"])
        order, merged = merge_runs(args.merge)
        summary = summarize([side_figures(merged[key]) for key in order], settings)
        summary["runs"] = [asdict(run) for key in order for run in merged[key]]
        print_report(summary, common.make_console())
        common.write_json(args.json, summary)
        return 0
    peers = [p for p in args.peers.split(",") if p]
    procs = sorted({int(n) for n in args.procs.split(",") if n})
    try:
        allocators = common.allocator_names(args.allocators)
    except ValueError as e:
        print(f"peers.py: --allocators: {e}", file=sys.stderr)
        return 2
    unknown = set(peers) - set(PEER_PACKAGES)
    if unknown or not procs or min(procs) < 1 or settings.steps < 1 or settings.warmup < 0 or settings.repeats < 1:
        print(f"peers.py: unknown peers {sorted(unknown)} or bad --procs/--steps/--warmup/--repeats", file=sys.stderr)
        return 2
    model_ranks = settings.tp * settings.pp
    if settings.tp < 1 or settings.pp < 1 or any(n > 1 and n % model_ranks for n in procs):
        print(f"peers.py: --tp {settings.tp} x --pp {settings.pp} must divide every process count above 1 ({procs})",
              file=sys.stderr)  # fmt: skip
        return 2
    if settings.pp > 1 and any(n > 1 and settings.rows(n) % settings.pp for n in procs):
        print(f"peers.py: --pp {settings.pp} needs a multiple of {settings.pp} windows (micro-batches) per "
              "data-parallel rank and step", file=sys.stderr)  # fmt: skip
        return 2
    if settings.pp > 1 and min(settings.stage_layers()) < 1:
        print(f"peers.py: {settings.num_layers} layers do not cut into the stages of --pp {settings.pp} "
              f"{settings.pp_schedule}: {settings.stage_layers()}", file=sys.stderr)  # fmt: skip
        return 2
    if any(
        settings.rows(n) < 1 or settings.rows(n) * settings.data_ranks(n) * settings.seq_len != settings.batch_tokens
        for n in procs
    ):
        print(f"peers.py: {settings.batch_tokens} tokens/step do not split into windows over {procs}", file=sys.stderr)
        return 2
    console = common.make_console()
    quiet = common.quiet_wait_s(args)
    pythons: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for name in peers:
        reason = SMOKE_SKIP if args.smoke else install_peer(name, console)
        if reason is None:
            pythons[name] = str(peer_python(name))
        else:
            reasons[name] = reason
    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="lmforge-peers-"))
    try:
        start = write_start(settings, work_root / "start")
        plans = {a: plan_sides(replace(settings, allocator=a), procs, peers, args.smoke, pythons, reasons, start)
                 for a in allocators}  # fmt: skip
        runs: dict[Key, list[Run]] = {(a, side, n): [] for a, plan in plans.items() for side, n, _ in plan}
        for allocator, plan in plans.items():
            for r in range(settings.repeats):
                for side, n, job in common.in_turn(plan, r):
                    if isinstance(job, str):
                        status, reason = job.split(": ", 1)
                        runs[allocator, side, n].append(Run(side, n, allocator, status=status, reason=reason))
                        continue
                    work = work_root / allocator / f"{side.replace(' ', '-')}-{n}-{r + 1}"
                    work.mkdir(parents=True, exist_ok=True)
                    settle(quiet)
                    run = job(work, None)
                    runs[allocator, side, n].append(run)
                    ok = run.status == "ok"
                    figure = f"{run.tokens_per_s:,.0f} tokens/s" if ok else f"{run.status}: {run.reason}"
                    console.print(
                        f"{allocator} run {r + 1}/{settings.repeats} {side} x{n}: {figure}, peak RSS "
                        f"{run.peak_rss_mib:,.0f} MiB, other processes {run.foreign_cores:.2f} cores "
                        f"({run.wall_s:.0f} s)",
                        highlight=False,
                    )
        if args.profile is not None:
            profile_sides(plans[allocators[0]], work_root / "profile", args.profile, quiet, console)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_root, ignore_errors=True)
    summary = summarize([side_figures(runs[key]) for key in runs], settings)
    summary["runs"] = [asdict(run) for key in runs for run in runs[key]]
    print_report(summary, console)
    common.write_json(args.json, summary)
    ours = [side_figures(runs[key]) for key in runs if not key[1].startswith(("torchtitan", "litgpt"))]
    return 1 if any(r.status == "failed" for r in ours) else 0


if __name__ == "__main__":
    sys.exit(main())
