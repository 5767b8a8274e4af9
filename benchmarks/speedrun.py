"""Speedrun: wall time to a held-out loss, lmforge's default recipe against an independent nanoGPT-style baseline.

Both sides train the same Llama (d384 x 6 blocks, 6 heads of 64, SwiGLU 1024, untied head, about 13M parameters
with the demo's 4096-token vocabulary) from scratch on the demo corpus (`lmforge demo --prepare-only`: Shakespeare,
byte-level BPE, `data/demo/train`), with the same tokens per step (32 windows of 256 = 8,192), the same threads
and malloc settings, eager (or both compiled with `--compile`), and are scored on the same held-out chunks: the
documents of `data/demo/heldout` that fill the first `--heldout-tokens` tokens, each cut into chunks of 256.

1. **Baseline** (`speedrun_baseline.py`, no lmforge code): AdamW, warmup + cosine to 0.1 x lr, GPT-2 init, random
   windows of the token stream. Its step count is the wall budget (`--budget`, 10 minutes) divided by its own step
   time, measured in a short calibration run. Its learning rate is the best (lowest held-out loss) of a sweep at
   seed 0, extended 2x beyond an edge (up to `max_extend` times) while the best lies at one; it then runs at that
   lr with the other seeds.
2. **Target**: the median over seeds of the baseline's best held-out loss. The baseline's time to target is, per
   seed, the training time at which its held-out loss first reaches the target (linear between evaluations; a seed
   that never reaches it counts as infinite), and the figure is the median over seeds.
3. **lmforge**: `lmforge train` with the model shape and the data set, and otherwise its defaults (Muon with
   AdamW groups, warmup-stable-decay), plus a learning rate (lmforge has no default one: the best of
   `--lmforge-lrs` at seed 0 in the longest run), validation every `--eval-every` steps and a log line per step.
   A scheduled recipe reaches a loss soonest in a run whose decay ends there, so lmforge runs at several lengths
   (`--fractions` of the baseline's step count) per seed; its time to target is, per seed, the least training time
   at which any of those runs first reaches the target, summed from the runs' own `time/step` (which excludes
   validation and checkpoints, as the baseline's timer does).
4. **Ratio**: lmforge's median time to target / the baseline's. Goal: <= 0.33.
5. **Both scorers agree**: the final weights of the baseline's seed-0 run at its best lr, exported as an HF Llama
   folder and scored by `lmforge eval --model`, give the baseline's own final held-out loss within 1e-3.

Every run is a process of its own, one at a time; the figures are wall times, so run it on idle cores (the script
waits up to `--quiet-wait` seconds for them). The full run takes about 2 hours on 2 cores with a 10-minute budget.

    .venv/bin/python benchmarks/speedrun.py [--budget S] [--baseline-lrs 1e-3 ...] [--lmforge-lrs X ...]
        [--seeds 0 1 2] [--fractions 1 0.5 0.33] [--eval-every N] [--data-dir data/demo] [--work-dir D] [--json F]
    .venv/bin/python benchmarks/speedrun.py --smoke      # a tiny model, fixed step counts (~30 s)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import common
from cpu_load import ForeignLoad, settle
from speedrun_baseline import read_token_folder, vocab_size_of

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


def lmforge_run(s: Settings, data: Path, heldout: Path, work: Path, steps: int, seed: int, lr: float) -> dict[str, Any]:
    """One `lmforge train` run's curve."""
    out = work / f"lmforge_lr{lr:g}_s{seed}_n{steps}"
    cfg = work / f"{out.name}.toml"
    cfg.write_text(lmforge_config(s, data, heldout, out, steps, seed, lr))
    run([sys.executable, "-m", "lmforge", "train", "@", str(cfg), "--overwrite"], s, work / f"{out.name}.log")
    curve = lmforge_curve(out, s.seq_len)
    return {"seed": seed, "steps": steps, "lr": lr, "curve": curve, "final_heldout": curve[-1][3],
            "train_s": sum(json.loads(x).get("time/step", 0.0) for x in (out / "metrics.jsonl").open())}  # fmt: skip


def scorer_check(s: Settings, data: Path, heldout: Path, work: Path, export: Path, own: float) -> dict[str, Any]:
    """`lmforge eval --model` on the baseline's exported weights against the baseline's own final figure."""
    cfg = work / "score.toml"
    cfg.write_text(lmforge_config(s, data, heldout, work / "score_run", 1, 0, s.lmforge_lrs[0]))
    out = work / "score.json"
    run([sys.executable, "-m", "lmforge", "eval", "--model", str(export), "--config", str(cfg), "--json", str(out)],
        s, work / "score.log")  # fmt: skip
    lmforge = json.loads(out.read_text())[f"val/heldout/loss@{s.seq_len}"]
    return {"baseline": own, "lmforge_eval": lmforge, "diff": abs(lmforge - own), "agree": abs(lmforge - own) <= 1e-3}


# ---------------------------------------------------------------------------------------------- the benchmark


def measure(s: Settings, data: Path, work: Path, say: Any) -> dict[str, Any]:
    """Every run and the figures read off them (see the module docstring)."""
    heldout = work / "heldout"
    tokenizer_name = str(data / "tokenizer" / "tokenizer.json")
    held = heldout_subset(data / "heldout", heldout, s.heldout_tokens, tokenizer_name)
    figures: dict[str, Any] = {"settings": asdict(s), "heldout_tokens": held, "vocab_size": vocab_size_of(
        data / "tokenizer")}  # fmt: skip
    if s.steps is None:
        steps, step_s = calibrated_steps(s, data, heldout, work)
        figures["calibration"] = {"step_s": step_s, "steps": steps}
        say(f"baseline: {step_s:.3f} s a step -> {steps} steps in {s.budget_s:.0f} s")
    else:
        steps = s.steps
    figures["baseline_steps"] = steps
    sweep: dict[float, dict[str, Any]] = {}

    def best_of(lr: float) -> float:
        return min(c[3] for c in sweep[lr]["curve"])

    lrs, extended = list(s.baseline_lrs), 0
    while lrs:
        lr = lrs.pop(0)
        name = f"baseline_lr{len(sweep)}_s{s.seeds[0]}"
        sweep[lr] = baseline(s, data, heldout, work, name, lr, s.seeds[0], steps, True)
        sweep[lr]["name"] = name
        say(f"baseline lr {lr:g} seed {s.seeds[0]}: best held-out {best_of(lr):.4f}")
        if not lrs and extended < s.max_extend and len(sweep) > 1:
            # The best lr at an edge of those tried: one more, 2x beyond it, so a worse one brackets it.
            tried = sorted(sweep)
            best = min(tried, key=best_of)
            if best in (tried[0], tried[-1]):
                lrs.append(best / 2 if best == tried[0] else best * 2)
                extended += 1
    best_lr = min(sweep, key=best_of)
    figures["sweep"] = [{"lr": lr, "best_heldout": best_of(lr), "final_heldout": sweep[lr]["final_heldout"],
                         "train_s": sweep[lr]["train_s"]} for lr in sorted(sweep)]  # fmt: skip
    figures["best_lr"] = best_lr
    figures["params"] = sweep[best_lr]["params"]
    runs = {s.seeds[0]: sweep[best_lr]}
    for seed in s.seeds[1:]:
        runs[seed] = baseline(s, data, heldout, work, f"baseline_s{seed}", best_lr, seed, steps)
        say(f"baseline lr {best_lr:g} seed {seed}: best held-out {min(c[3] for c in runs[seed]['curve']):.4f}")
    target = statistics.median(min(c[3] for c in f["curve"]) for f in runs.values())
    figures["target"] = target
    figures["baseline"] = [{"seed": seed, "best_heldout": min(c[3] for c in f["curve"]), "train_s": f["train_s"],
                            "time_to_target": crossing_time(f["curve"], target), "curve": f["curve"]}
                           for seed, f in runs.items()]  # fmt: skip
    export = work / sweep[best_lr]["name"] / "export"
    figures["scorers"] = scorer_check(s, data, heldout, work, export, sweep[best_lr]["final_heldout"])
    say(
        f"scorers: baseline {figures['scorers']['baseline']:.5f}, lmforge eval {figures['scorers']['lmforge_eval']:.5f}"
    )
    longest = max(s.fractions)

    def lmforge_side(seed: int, fraction: float, lr: float) -> dict[str, Any]:
        r = lmforge_run(s, data, heldout, work, max(1, round(fraction * steps)), seed, lr)
        r["fraction"] = fraction
        r["time_to_target"] = crossing_time(r["curve"], target)
        say(f"lmforge lr {lr:g} seed {seed} {r['steps']} steps: final held-out {r['final_heldout']:.4f}, "
            f"time to target {r['time_to_target']:.1f} s")  # fmt: skip
        return r

    tried = {lr: lmforge_side(s.seeds[0], longest, lr) for lr in s.lmforge_lrs}
    lmforge_lr = min(tried, key=lambda lr: min(c[3] for c in tried[lr]["curve"]))
    figures["lmforge_sweep"] = [{"lr": lr, "best_heldout": min(c[3] for c in r["curve"]),
                                 "final_heldout": r["final_heldout"], "time_to_target": r["time_to_target"]}
                                for lr, r in tried.items()]  # fmt: skip
    figures["lmforge_lr"] = lmforge_lr
    lmforge = [
        tried[lmforge_lr] if (seed, fraction) == (s.seeds[0], longest) else lmforge_side(seed, fraction, lmforge_lr)
        for seed in s.seeds
        for fraction in s.fractions
    ]
    figures["lmforge"] = lmforge
    base_times = [b["time_to_target"] for b in figures["baseline"]]
    ours = [min(r["time_to_target"] for r in lmforge if r["seed"] == seed) for seed in s.seeds]
    figures["time_to_target"] = {"baseline": median_spread(base_times), "lmforge": median_spread(ours)}
    b, o = figures["time_to_target"]["baseline"]["median"], figures["time_to_target"]["lmforge"]["median"]
    # No ratio when the baseline's own median seed never reaches the target (only with an even number of seeds).
    figures["ratio"] = (o / b if math.isfinite(o) else math.inf) if math.isfinite(b) and b > 0 else None
    figures["ratio_met"] = figures["ratio"] is not None and figures["ratio"] <= 0.33
    return figures


def _s(x: float) -> str:
    return "never" if not math.isfinite(x) else f"{x:.1f}"


def print_report(f: dict[str, Any], console: Any) -> None:
    """The sweep, the seeds of both sides and the ratio, as tables."""
    s = f["settings"]
    sweep = common.result_table(f"Baseline lr sweep (seed {s['seeds'][0]}, {f['baseline_steps']} steps)",
                                ["lr", "best held-out", "final held-out", "train s"])  # fmt: skip
    for row in f["sweep"]:
        mark = " (best)" if row["lr"] == f["best_lr"] else ""
        sweep.add_row(f"{row['lr']:g}{mark}", f"{row['best_heldout']:.4f}", f"{row['final_heldout']:.4f}",
                      f"{row['train_s']:.1f}")  # fmt: skip
    console.print(sweep)
    ours = common.result_table(f"lmforge lr sweep (seed {s['seeds'][0]}, the longest run)",
                               ["lr", "best held-out", "final held-out", "time to target s"])  # fmt: skip
    for row in f["lmforge_sweep"]:
        mark = " (best)" if row["lr"] == f["lmforge_lr"] else ""
        ours.add_row(f"{row['lr']:g}{mark}", f"{row['best_heldout']:.4f}", f"{row['final_heldout']:.4f}",
                     _s(row["time_to_target"]))  # fmt: skip
    console.print(ours)
    runs = common.result_table(f"Time to held-out loss {f['target']:.4f} (the baseline's median best)",
                               ["side", "seed", "steps", "final held-out", "train s", "time to target s"])  # fmt: skip
    for b in f["baseline"]:
        runs.add_row("baseline", str(b["seed"]), str(f["baseline_steps"]), f"{b['best_heldout']:.4f} (best)",
                     f"{b['train_s']:.1f}", _s(b["time_to_target"]))  # fmt: skip
    for r in f["lmforge"]:
        runs.add_row("lmforge", str(r["seed"]), str(r["steps"]), f"{r['final_heldout']:.4f}", f"{r['train_s']:.1f}",
                     _s(r["time_to_target"]))  # fmt: skip
    console.print(runs)
    t = f["time_to_target"]
    ratio = "undefined" if f["ratio"] is None else f"{f['ratio']:.3f}"
    console.print(
        f"time to target, median (min-max) over seeds: baseline {_s(t['baseline']['median'])} s "
        f"({_s(t['baseline']['min'])}-{_s(t['baseline']['max'])}), lmforge {_s(t['lmforge']['median'])} s "
        f"({_s(t['lmforge']['min'])}-{_s(t['lmforge']['max'])}); ratio {ratio} "
        f"(goal <= 0.33: {common.verdict(f['ratio_met'])})",
        highlight=False,
    )
    sc = f["scorers"]
    console.print(f"scorers: baseline {sc['baseline']:.5f}, lmforge eval {sc['lmforge_eval']:.5f}, |diff| "
                  f"{sc['diff']:.2e} (<= 1e-3: {common.verdict(sc['agree'])})", highlight=False)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budget", type=float, default=None, help="baseline wall budget in seconds (default 600)")
    p.add_argument("--steps", type=int, default=None, help="baseline steps instead of the budget (smoke 8)")
    p.add_argument("--baseline-lrs", type=float, nargs="+", default=None, help="baseline lr sweep")
    p.add_argument("--max-extend", type=int, default=None, help="lrs added beyond an edge of the sweep (default 2)")
    p.add_argument(
        "--lmforge-lrs",
        type=float,
        nargs="+",
        default=None,
        help="lmforge's optim.lr, the best of these at seed 0 (default 2^-8 2^-7 2^-6)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2)")
    p.add_argument("--fractions", type=float, nargs="+", default=None, help="lmforge run lengths (default 1 0.5 0.33)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations (default 10)")
    p.add_argument("--heldout-tokens", type=int, default=None, help="held-out tokens scored (default 32768)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of every run (default 2)")
    p.add_argument("--compile", action="store_true", help="torch.compile on both sides")
    p.add_argument("--data-dir", type=Path, default=Path("data/demo"), help="demo data (built there if missing)")
    p.add_argument("--work-dir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--quiet-wait", type=float, default=None, help="wait up to S s for idle CPUs (default 60; smoke 0)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 8 steps, 2 lrs, 1 seed: checks the script runs")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The preset (default or smoke) with the flags that were set."""
    s = SMOKE if args.smoke else Settings()
    changes = {"budget_s": args.budget, "steps": args.steps,
               "lmforge_lrs": tuple(args.lmforge_lrs) if args.lmforge_lrs else None,
               "eval_every": args.eval_every, "heldout_tokens": args.heldout_tokens, "threads": args.threads,
               "max_extend": args.max_extend,
               "baseline_lrs": tuple(args.baseline_lrs) if args.baseline_lrs else None,
               "seeds": tuple(dict.fromkeys(args.seeds)) if args.seeds else None,
               "fractions": tuple(args.fractions) if args.fractions else None}  # fmt: skip
    s = replace(s, **{k: v for k, v in changes.items() if v is not None})
    return replace(s, compile=True) if args.compile else s


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, run both sides, print the tables and write the JSON. Exits 0 when every run finished."""
    from lmforge.prep.demo_data import prepare_demo_data

    args = parse_args(argv)
    s = settings_from_args(args)
    console = common.make_console()
    data = args.data_dir.resolve()
    prepare_demo_data(data, console)
    settle(args.quiet_wait if args.quiet_wait is not None else (0.0 if args.smoke else 60.0))
    foreign, t0 = ForeignLoad(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmforge-speedrun-") as tmp:
        work = (args.work_dir or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        try:
            figures = measure(s, data, work, lambda line: console.print(line, highlight=False))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"speedrun.py: {e}", file=sys.stderr)
            return 1
    wall = time.perf_counter() - t0
    figures["wall_s"] = wall
    # The runs are child processes: foreign load is the machine's busy time beyond one run's own cores.
    figures["foreign_cores"] = max(foreign.cores(wall) - s.threads, 0.0)
    print_report(figures, console)
    console.print(f"{wall / 60:.1f} min in all", highlight=False)
    common.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
