"""The runs of the speedrun (`speedrun.py`, `speedrun_ablations.py`): the settings both sides share, one baseline
run (`speedrun_baseline.py` in a process of its own), one `lmforge train` run, the held-out subset both score, the
time at which a curve reaches a loss, and `lmforge eval --model` on an exported model.

Every run is a child process with the same environment: `threads` torch threads and lmforge's malloc setting
(`common.ALLOCATORS`), so that no side gets a faster allocator than the other.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import common
from speedrun_baseline import read_token_folder

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Settings:
    """What both sides share, the budget, the sweeps and the seeds."""

    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 6
    num_heads: int = 6
    seq_len: int = 256
    batch_tokens: int = 8192
    micro_batch_tokens: int = 2048
    budget_s: float = 600.0
    steps: int | None = None
    """Baseline steps; None: from the budget and a calibration run."""
    calibrate_steps: int = 8
    baseline_lrs: tuple[float, ...] = (1e-3, 2e-3, 4e-3)
    max_extend: int = 2
    """Lrs that may be added (2x beyond the edge) while the best baseline lr lies at an edge of those tried."""
    lmforge_lrs: tuple[float, ...] = (2**-8, 2**-7, 2**-6)
    """optim.lr of lmforge's runs: the best (lowest held-out loss) of these at seed 0, full length."""
    seeds: tuple[int, ...] = (0, 1, 2)
    fractions: tuple[float, ...] = (1.0, 0.5, 0.33)
    eval_every: int = 10
    heldout_tokens: int = 32768
    threads: int = 2
    compile: bool = False
    timeout_s: float = 3600.0


SMOKE = Settings(hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, seq_len=64, batch_tokens=512,
                 micro_batch_tokens=256, steps=8, baseline_lrs=(2e-3, 8e-3), lmforge_lrs=(2**-7, 2**-5), seeds=(0,),
                 fractions=(1.0, 0.5),
                 max_extend=1, eval_every=2, heldout_tokens=4096, timeout_s=300.0)  # fmt: skip


# ---------------------------------------------------------------------------------------------- pieces


def crossing_time(curve: list[list[float]], target: float) -> float:
    """Training seconds at which a curve of [step, tokens, train_s, loss] first reaches `target` (linear between
    the two evaluations around it); infinity if it never does."""
    for i, (_, _, t, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return t
            t0, l0 = curve[i - 1][2], curve[i - 1][3]
            return t0 + (l0 - target) / (l0 - loss) * (t - t0)
    return math.inf


def median_spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def heldout_subset(source: Path, out: Path, tokens: int, tokenizer: str) -> int:
    """The first documents of `source` that fill `tokens` tokens (the one that crosses the mark included), as one
    shard in `out`; returns its token count."""
    ids, ends = read_token_folder(source)
    keep = ends[: int(np.searchsorted(ends, tokens)) + 1]
    out.mkdir(parents=True, exist_ok=True)
    shard = out / "00000_heldout.ds"
    ids[: int(keep[-1])].astype("<u2").tofile(shard)
    common.write_shard_index(shard, keep, tokenizer)
    return int(keep[-1])


def environment(s: Settings) -> dict[str, str]:
    """Every side's environment: the same threads and lmforge's malloc setting."""
    threads = str(s.threads)
    return {**os.environ, **common.ALLOCATORS["lmforge"], "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def run(cmd: list[str], s: Settings, log: Path) -> None:
    """Run a side to the end, its output in `log`; a failure raises with the log's tail."""
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(s), cwd=ROOT,
                              timeout=s.timeout_s, check=False).returncode  # fmt: skip
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{log.read_text()[-3000:]}")


# ---------------------------------------------------------------------------------------------- the baseline


def baseline(s: Settings, data: Path, heldout: Path, work: Path, name: str, lr: float, seed: int, steps: int,
             export: bool = False) -> dict[str, Any]:  # fmt: skip
    """One baseline run's figures (`speedrun_baseline.train`)."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "speedrun_baseline.py"), "--train", str(data / "train"), "--heldout",
           str(heldout), "--tokenizer", str(data / "tokenizer"), "--json", str(out / "figures.json"),
           "--hidden-size", str(s.hidden_size), "--intermediate-size", str(s.intermediate_size),
           "--num-layers", str(s.num_layers), "--num-heads", str(s.num_heads), "--num-kv-heads", str(s.num_heads),
           "--seq-len", str(s.seq_len), "--batch", str(s.batch_tokens // s.seq_len),
           "--micro-batch", str(s.micro_batch_tokens // s.seq_len), "--steps", str(steps), "--lr", str(lr),
           "--seed", str(seed), "--eval-every", str(s.eval_every), "--threads", str(s.threads)]  # fmt: skip
    if s.compile:
        cmd.append("--compile")
    if export:
        cmd += ["--export", str(out / "export")]
    run(cmd, s, out / "log.txt")
    return json.loads((out / "figures.json").read_text())


def calibrated_steps(s: Settings, data: Path, heldout: Path, work: Path) -> tuple[int, float]:
    """The baseline's steps in the budget and its step time (median of a short run's steps after the first)."""
    fig = baseline(replace(s, eval_every=10**6), data, heldout, work, "calibration", s.baseline_lrs[0], 0,
                   s.calibrate_steps)  # fmt: skip
    step_s = statistics.median(fig["step_s"][1:])
    return max(1, int(s.budget_s / step_s)), step_s


# ---------------------------------------------------------------------------------------------- lmforge


def lmforge_config(s: Settings, data: Path, heldout: Path, out: Path, steps: int, seed: int, lr: float) -> str:
    """The lmforge run: the model shape, the data set and the speedrun's lr and validation; the rest defaults."""
    return f"""max_steps = {steps}
output_dir = "{out}"

[tokenizer]
name = "{data / "tokenizer"}"

[model.arch]
model_type = "llama"
hidden_size = {s.hidden_size}
intermediate_size = {s.intermediate_size}
num_hidden_layers = {s.num_layers}
num_attention_heads = {s.num_heads}
max_position_embeddings = {s.seq_len}

[model]
compile = {str(s.compile).lower()}

[model.init]
seed = {seed}

[data]
type = "tokens"
paths = ["{data / "train"}"]
seq_len = {s.seq_len}
batch_tokens = {s.batch_tokens}
micro_batch_tokens = {s.micro_batch_tokens}
seed = {seed}
max_epochs = 100

[optim]
lr = {lr!r}

[val]
interval = {s.eval_every}
sets = [{{ name = "heldout", path = "{heldout}" }}]

[log]
interval = 1
"""


def lmforge_curve(run_dir: Path, seq_len: int) -> list[list[float]]:
    """[step, tokens, train_s, held-out loss] of every validation of a run, train_s summed from `time/step`."""
    key = f"val/heldout/loss@{seq_len}"
    curve, train_s, tokens = [], 0.0, 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        train_s += rec.get("time/step", 0.0)
        tokens = rec.get("progress/num_tokens", tokens)
        if key in rec and not (curve and curve[-1][0] == rec["step"]):
            curve.append([rec["step"], tokens, train_s, rec[key]])
    return curve


def lmforge_run(s: Settings, data: Path, heldout: Path, work: Path, steps: int, seed: int, lr: float,
                flags: tuple[str, ...] = (), tag: str = "") -> dict[str, Any]:  # fmt: skip
    """One `lmforge train` run's curve; `flags` go after the config (an option under test), `tag` into its name."""
    out = work / f"lmforge{tag}_lr{lr:g}_s{seed}_n{steps}"
    cfg = work / f"{out.name}.toml"
    cfg.write_text(lmforge_config(s, data, heldout, out, steps, seed, lr))
    run([sys.executable, "-m", "lmforge", "train", "@", str(cfg), *flags, "--overwrite"], s, work / f"{out.name}.log")
    curve = lmforge_curve(out, s.seq_len)
    step_s = [json.loads(x).get("time/step") for x in (out / "metrics.jsonl").open()]
    step_s = [t for t in step_s if t is not None]
    return {"seed": seed, "steps": steps, "lr": lr, "flags": list(flags), "curve": curve,
            "final_heldout": curve[-1][3], "train_s": sum(step_s),
            "median_step_s": statistics.median(step_s[1:] or step_s)}  # fmt: skip


def scorer_check(s: Settings, data: Path, heldout: Path, work: Path, export: Path, own: float) -> dict[str, Any]:
    """`lmforge eval --model` on the baseline's exported weights against the baseline's own final figure."""
    cfg = work / "score.toml"
    cfg.write_text(lmforge_config(s, data, heldout, work / "score_run", 1, 0, s.lmforge_lrs[0]))
    out = work / "score.json"
    run([sys.executable, "-m", "lmforge", "eval", "--model", str(export), "--config", str(cfg), "--json", str(out)],
        s, work / "score.log")  # fmt: skip
    lmforge = json.loads(out.read_text())[f"val/heldout/loss@{s.seq_len}"]
    return {"baseline": own, "lmforge_eval": lmforge, "diff": abs(lmforge - own), "agree": abs(lmforge - own) <= 1e-3}
