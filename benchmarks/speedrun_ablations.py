"""Ablations on the speedrun: what each recipe option does to lmforge's held-out loss and time to target.

It starts from a finished speedrun (`speedrun.py --json F`, passed as `--reference F`): the same model, data,
held-out chunks, run lengths (the baseline's step count and `--fractions` of it), the target loss (the baseline's
median best) and lmforge's learning rate. For every seed it trains lmforge's default recipe and the recipe with
each option's flags (`OPTIONS`), all in this invocation, one run at a time and seed by seed, so that every arm
meets the same machine speed. Per option, over seeds (median, then min and max):

- **Δ held-out loss**: the option's final held-out loss minus the default's, in the longest run (the same steps
  and tokens). `step time` is the option's median step time over the default's: where it is about 1, equal steps
  are equal wall time; where it is not, the Δ is at equal tokens and the step time says by how much the wall
  time differs.
- **Δ time to target**: the least training time at which any run length of the option first reaches the target,
  minus the default's (as `speedrun.py` reads it, from each run's own `time/step`).

An option helps beyond noise when its Δ loss is negative on every seed and its median is beyond the default's
spread (max - min of its seeds' losses), which the table reports as `spread`.

    .venv/bin/python benchmarks/speedrun_ablations.py --reference speedrun.json [--options relu2 z_loss ...]
        [--seeds 0 1 2] [--fractions 1 0.5] [--data-dir data/demo] [--work-dir D] [--json F]
    .venv/bin/python benchmarks/speedrun_ablations.py --smoke     # a tiny speedrun, then two options (~40 s)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import common
from cpu_load import settle
from speedrun_runs import SMOKE, Settings, crossing_time, heldout_subset, lmforge_run, median_spread

OPTIONS: dict[str, tuple[str, ...]] = {
    "polar_express": ("--optim.orthogonalizer", "polar_express"),
    "normuon": ("--optim.normuon",),
    "cautious_wd": ("--optim.cautious_weight_decay",),
    # QK-norm: qwen3 is llama plus per-head RMSNorm on queries and keys; keep the llama's rope base and norm eps
    "qk_norm": (
        "--model.arch.model_type",
        "qwen3",
        "--model.arch.rope_theta",
        "10000.0",
        "--model.arch.rms_norm_eps",
        "1e-5",
    ),
    "relu2": ("--model.arch.hidden_act", "relu2"),
    "zero_out_proj": ("--model.init.zero_out_proj",),
    "z_loss": ("--model.z_loss", "1e-4"),
    "embed_lr_x4": ("--optim.lr_multipliers", "{embed = 4.0}"),
    "head_lr_half": ("--optim.lr_multipliers", "{head = 0.5}"),
    "cooldown_sqrt": ("--schedule.decay_shape", "sqrt"),
    "cooldown_40": ("--schedule.decay", "0.4"),
}
"""Each option's flags on top of the default recipe's config."""

SMOKE_OPTIONS = ("relu2", "z_loss")
DEFAULT = "default"


def ablate(s: Settings, reference: dict[str, Any], options: list[str], data: Path, work: Path,
           say: Any) -> dict[str, Any]:  # fmt: skip
    """Every arm's runs and the Δ figures of each option (see the module docstring)."""
    heldout = work / "heldout"
    heldout_subset(data / "heldout", heldout, s.heldout_tokens, str(data / "tokenizer" / "tokenizer.json"))
    steps, target, lr = reference["baseline_steps"], reference["target"], reference["lmforge_lr"]
    arms = [DEFAULT, *options]
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {arm: {} for arm in arms}
    for seed in s.seeds:
        for arm in arms:
            flags = OPTIONS.get(arm, ())
            for fraction in sorted(s.fractions, reverse=True):
                r = lmforge_run(s, data, heldout, work, max(1, round(fraction * steps)), seed, lr, flags, f"_{arm}")
                r["fraction"] = fraction
                r["time_to_target"] = crossing_time(r["curve"], target)
                runs[arm].setdefault(seed, []).append(r)
                say(f"{arm} seed {seed} {r['steps']} steps: final held-out {r['final_heldout']:.4f}, time to target "
                    f"{r['time_to_target']:.1f} s, {r['median_step_s']:.3f} s a step")  # fmt: skip
    rows = [summarize(arm, runs, s.seeds) for arm in arms]
    return {"settings": {**reference["settings"], "seeds": list(s.seeds), "fractions": list(s.fractions)},
            "target": target, "lmforge_lr": lr, "baseline_steps": steps, "options": {o: OPTIONS[o] for o in options},
            "rows": rows, "runs": runs}  # fmt: skip


def summarize(arm: str, runs: dict[str, dict[int, list[dict[str, Any]]]], seeds: tuple[int, ...]) -> dict[str, Any]:
    """One arm's figures per seed (the longest run's final loss, time to target, step time) and, for an option,
    its Δs against the default's same seed."""

    def per_seed(name: str) -> tuple[list[float], list[float], list[float]]:
        longest = [max(runs[name][seed], key=lambda r: r["steps"]) for seed in seeds]
        return ([r["final_heldout"] for r in longest],
                [min(r["time_to_target"] for r in runs[name][seed]) for seed in seeds],
                [r["median_step_s"] for r in longest])  # fmt: skip

    losses, times, step_s = per_seed(arm)
    row: dict[str, Any] = {"arm": arm, "flags": list(OPTIONS.get(arm, ())), "losses": losses, "times": times,
                           "loss": median_spread(losses), "time_to_target": statistics.median(times),
                           "step_s": statistics.median(step_s)}  # fmt: skip
    row["spread"] = row["loss"]["max"] - row["loss"]["min"]
    if arm != DEFAULT:
        base_losses, base_times, base_step_s = per_seed(DEFAULT)
        row["loss_deltas"] = [a - b for a, b in zip(losses, base_losses, strict=True)]
        row["time_deltas"] = [a - b for a, b in zip(times, base_times, strict=True)]
        row["delta_loss"] = median_spread(row["loss_deltas"])
        row["delta_time"] = statistics.median(row["time_deltas"])
        row["step_time_ratio"] = row["step_s"] / statistics.median(base_step_s)
    return row


def _f(x: float, sign: bool = False) -> str:
    if not math.isfinite(x):
        return "never" if x > 0 else str(x)
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def print_report(f: dict[str, Any], console: Any) -> None:
    """One row per arm."""
    table = common.result_table(
        f"Ablations: target {f['target']:.4f}, lr {f['lmforge_lr']:g}, seeds {f['settings']['seeds']}",
        ["arm", "held-out (median)", "spread", "Δ loss median", "Δ loss per seed", "time to target s",
         "Δ time s", "step time"],
    )  # fmt: skip
    default = next(r for r in f["rows"] if r["arm"] == DEFAULT)
    for row in f["rows"]:
        if row["arm"] == DEFAULT:
            table.add_row(DEFAULT, _f(row["loss"]["median"]), f"{row['spread']:.4f}", "", "",
                          f"{row['time_to_target']:.1f}", "", "1.00x")  # fmt: skip
            continue
        beyond = all(d < 0 for d in row["loss_deltas"]) and -row["delta_loss"]["median"] > default["spread"]
        table.add_row(row["arm"] + (" (gain)" if beyond else ""), _f(row["loss"]["median"]), f"{row['spread']:.4f}",
                      _f(row["delta_loss"]["median"], True), " ".join(f"{d:+.3f}" for d in row["loss_deltas"]),
                      f"{row['time_to_target']:.1f}", f"{row['delta_time']:+.1f}",
                      f"{row['step_time_ratio']:.2f}x")  # fmt: skip
    console.print(table)


def smoke_reference(s: Settings, data: Path, work: Path, say: Any) -> dict[str, Any]:
    """A tiny speedrun to ablate from (`--smoke`)."""
    from speedrun import measure

    return measure(replace(s, fractions=(1.0,), lmforge_lrs=(2**-5,)), data, work / "reference", say)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reference", type=Path, default=None, help="a speedrun's --json figures (not with --smoke)")
    p.add_argument("--options", nargs="+", choices=list(OPTIONS), default=None, metavar="NAME",
                   help=f"options to ablate (default all): {', '.join(OPTIONS)}")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the reference's)")
    p.add_argument("--fractions", type=float, nargs="+", default=None, help="run lengths (default: the reference's)")
    p.add_argument("--data-dir", type=Path, default=Path("data/demo"), help="demo data (built there if missing)")
    p.add_argument("--work-dir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--quiet-wait", type=float, default=None, help="wait up to S s for idle CPUs (default 60; smoke 0)")
    p.add_argument("--smoke", action="store_true", help=f"a tiny speedrun, then {' and '.join(SMOKE_OPTIONS)}, seed 0")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Ablate each option against the default recipe; print the table and write the JSON."""
    from lmforge.prep.demo_data import prepare_demo_data

    args = parse_args(argv)
    if (args.reference is None) != args.smoke:
        print("speedrun_ablations.py: give --reference FIGURES.json, or --smoke", file=sys.stderr)
        return 2
    console = common.make_console(width=140)
    say = lambda line: console.print(line, highlight=False)  # noqa: E731
    data = args.data_dir.resolve()
    prepare_demo_data(data, console)
    settle(args.quiet_wait if args.quiet_wait is not None else (0.0 if args.smoke else 60.0))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmforge-ablations-") as tmp:
        work = (args.work_dir or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        reference = smoke_reference(SMOKE, data, work, say) if args.smoke else json.loads(args.reference.read_text())
        known = {f.name for f in fields(Settings)}
        s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in reference["settings"].items()
                        if k in known})  # fmt: skip
        s = replace(s, seeds=tuple(args.seeds or ((0,) if args.smoke else s.seeds)),
                    fractions=tuple(args.fractions or s.fractions))  # fmt: skip
        options = args.options or (list(SMOKE_OPTIONS) if args.smoke else list(OPTIONS))
        figures = ablate(s, reference, options, data, work, say)
    figures["wall_s"] = time.perf_counter() - t0
    print_report(figures, console)
    common.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
