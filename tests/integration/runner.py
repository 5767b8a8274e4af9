"""Run the real CLI in subprocesses (plain and under torchrun) with bounded time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.config.arch import AnyArch
from lmforge.monitor import read_metrics
from tests.conftest import arch_toml, require, tiny_llama

TINY_ARCH = arch_toml(tiny_llama(max_position_embeddings=256))
"""The tiny Llama of the CLI tests (`tests.conftest.tiny_llama`), as a TOML section."""

TINY_RUN = (
    """
max_steps = {max_steps}
output_dir = "{output_dir}"
"""
    + TINY_ARCH
    + """
[data]
type = "fake"
seq_len = 64
batch_tokens = 1024
micro_batch_tokens = 128
vocab_size = 200
mean_doc_len = 24

[optim]
lr = 3e-3

[schedule]
warmup = 0.2
decay = 0.4
"""
)


def write_config(tmp_path: Path, name: str, max_steps: int = 6, arch: AnyArch | None = None) -> Path:
    """A tiny fake-data run config whose output_dir sits beside it (with `arch` instead of the tiny Llama)."""
    path = tmp_path / f"{name}.toml"
    run = TINY_RUN.format(max_steps=max_steps, output_dir=(tmp_path / name).as_posix())
    path.write_text(run if arch is None else run.replace(TINY_ARCH, arch_toml(arch)))
    return path


def env_one_thread() -> dict[str, str]:
    """Environment with one compute thread per process: results then do not depend on the thread count."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def cli_command(args: list[str], nproc: int = 1, script: Path | None = None) -> list[str]:
    """The command line of `lmforge <args>` (or of `script <args>`), plain or under torchrun."""
    entry = [str(script)] if script is not None else ["-m", "lmforge"]
    if nproc == 1:
        return [sys.executable, *entry, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry, *args]


def run_cli(
    args: list[str], nproc: int = 1, timeout: float = 240, script: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`lmforge <args>` as a plain process, or under torchrun with `nproc` processes; killed after `timeout`. `env`
    replaces the default environment (`env_one_thread()`)."""
    cmd = cli_command(args, nproc, script)
    env = env_one_thread() if env is None else env
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def train_run(cfg: Path, out: Path, *flags: str, nproc: int = 1, timeout: float = 300) -> Path:
    """`lmforge train @ cfg --output-dir out <flags>` on `nproc` processes, which must succeed; returns `out`."""
    result = run_cli(["train", "@", str(cfg), "--output-dir", str(out), *flags], nproc=nproc, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def curve(run_dir: Path, key: str) -> list[float]:
    """Per-step values of metric `key` in a finished run (the steps that logged it)."""
    return [r[key] for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0 and key in r]


def losses(run_dir: Path) -> list[float]:
    """Per-step loss/mean of a finished run."""
    return curve(run_dir, "loss/mean")


def same_curves(one: Path, runs: dict[str, Path], keys: tuple[str, ...], steps: int) -> None:
    """Every run in `runs` logged the metrics `keys` of the reference run `one` at each of its `steps` steps, within
    1e-5 relative (1e-6 absolute)."""
    for key in keys:
        want = curve(one, key)
        assert len(want) == steps, key
        for name, run in runs.items():
            assert curve(run, key) == pytest.approx(want, rel=1e-5, abs=1e-6), (name, key)


def exported_logits_gap(run: Path, model: torch.nn.Module, folder: Path) -> float:
    """Export `run` with `lmforge export` (float32) into `folder`, load that with transformers, and return the
    largest logit difference from `model` (the run's model as lmforge loads it) on 48 random token ids."""
    transformers = require("transformers")
    exported = run_cli(["export", str(run), "--output", str(folder), "--dtype", "float32"])
    assert exported.returncode == 0, exported.stderr[-2000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(48)[None], torch.tensor([48], dtype=torch.int32))
        theirs = hf(input_ids=ids).logits
    return (ours - theirs).abs().max().item()
