"""Research options of the GLM-4.5 MoE, one at a time: held-out loss and training tokens/s against the plain model.

Every variant trains the same small `glm4_moe` decoder from scratch on the demo's Shakespeare token shards
(`data/demo/train`, built by `lmforge demo --prepare-only`'s code if `--data-dir` lacks them) through the real
command line, `python -m lmforge train @ run.toml FLAGS`. The model and recipe follow examples/pretrain/moe.toml at a
smaller size: d128 x 4 blocks (the first dense, MLP 384; three MoE blocks of 8 routed experts of width 64, top-2, one
shared expert), 4 heads, RoPE on half of each head, the demo's 4,096-token vocabulary (untied); Muon at lr 3e-3 with
weight decay 0.1, warmup over 5% of the steps and a linear decay over the last 30%; the auxiliary-loss-free balance
(`[model.moe_balance]`, coeff 1e-2, frozen after 90% of the steps); seq_len 256 windows with document masking, 4,096
tokens a step in 2 packed rows of 2,048; fp32. `run.toml` is the same for every run; the variants differ only in
the flags:

- `baseline`: every option off (GLM-4.5 itself);
- one variant per row of `OPTIONS`: the baseline plus that row's flags (e.g. `--model.arch.xsa=true`), nothing else.
  `latent_moe` uses a latent width of half the hidden size (64 at d128).

Each variant trains once per seed (`--seeds`, default 0 1 2; a seed sets both `model.init.seed` and `data.seed`, so
a seed's runs see the same tokens in the same order) for `--warmup` + `--steps` optimizer steps (4 + 96 by default:
409,600 tokens, about a quarter of the 1.53M training tokens), so every variant trains on the same number of tokens
(not the same FLOPs: null experts skip work, a gate or hyper-connections add some). After the last step the trainer
scores all of `data/demo/heldout` (41 scenes, 107,546 tokens) once (`val.eval_on_end`; `val/heldout/loss@256`: the
mean cross-entropy over every scored token). Per variant the table gives the held-out loss's mean over the seeds and
its standard deviation, the difference of the means to the baseline's and the per-seed differences to the baseline
run of the same seed (same init seed and data order); the median of the trainer's `perf/throughput` (tokens over the
step's wall time) over every seed's timed steps (the `--warmup` first steps of a run are left out) and its ratio to
the baseline's; the parameter counts the trainer logs at step 0 (`params/total`, `params/active_non_embedding`); and
the last step's `max_vio/mean` (the busiest expert's load over the mean, minus 1, averaged over the MoE blocks and the
seeds). The JSON (`--json`) also has each seed's figures, the range and the train losses.

Runs are processes of their own, `--jobs` at a time (2 by default), each with `--threads` torch threads (1 by
default). Runs go seed by seed, each seed's variants in the table's order, so a run shares the CPUs with whichever
run is next in the queue: tokens/s are comparable between variants only on an otherwise idle machine, and `--jobs 1
--threads 2` times every run alone. The script waits for idle CPUs before it starts (`--quiet-wait`) and reports the
cores other processes used while it ran. Measured on the 2-core machine (2026-12-04, under 1-1.3 cores of other
load): `--smoke` took 18-40 s with the demo data already built (plus 11 s to build it); `--options xsa --seeds 0
--steps 20` (2 runs of 24 steps side by side) took 58 s a run at 3,434 tokens/s; a lone baseline run took 0.5 s a
step plus 8 s to start and score the held-out set. The default run (10 variants x 3 seeds: 30 runs of 100 steps)
took 17.0 minutes on idle CPUs (2026-12-04; the table is in docs/benchmarks.md).

Every variant's config is validated before anything trains. An option named with `--options` whose flags the config
does not know (an option not yet in this checkout) stops the script with the config's error; an option not named
(the default: all of `OPTIONS`) is skipped with a note instead, so the benchmark runs whatever this checkout has.

    .venv/bin/python benchmarks/moe_options.py [--options NAME ...] [--seeds S ...] [--steps N] [--warmup N]
                                               [--jobs N] [--threads N] [--data-dir DIR] [--quiet-wait S]
                                               [--json PATH]
    .venv/bin/python benchmarks/moe_options.py --smoke     # tiny model, 8 steps, seed 0, baseline + 2 options

The script exits 0 when every run finished (it is a benchmark, not a test). A failed option run is reported in its
row and the others go on (exit status 1 at the end); a failed baseline run stops the script with its log.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.markup import escape

import common
from cpu_load import cpu_busy_s, own_cpu_s, settle
from lmforge.config import ConfigError, TrainConfig, dump_toml, load_train_config
from lmforge.monitor import read_metrics
from lmforge.prep.demo_data import prepare_demo_data

BASELINE = "baseline"
"""The variant with every option off."""

OPTIONS: dict[str, list[str]] = {
    "gate_headwise": ["--model.arch.attn-output-gate=headwise"],
    "gate_elementwise": ["--model.arch.attn-output-gate=elementwise"],
    "xsa": ["--model.arch.xsa=true"],
    "hyper_connections": ["--model.arch.hyper-connections=4"],
    "null_experts": ["--model.arch.null-experts=4"],
    "router_bias_on_logits": ["--model.arch.router-bias-on-logits=true"],
    "latent_moe": ["--model.arch.moe-latent-size={half_hidden}"],
    "situ_glu": ["--model.arch.expert-glu=situ_glu"],
    "balance_quantile": ["--model.moe-balance.rule=quantile"],
}
"""Each option's variant: its name and the `lmforge train` flags that turn it on over the baseline's config.
`{half_hidden}` stands for half the hidden size of the run's settings (the latent MoE's width: 64 by default)."""

SMOKE_OPTIONS = ("gate_headwise", "null_experts")
"""The options of `--smoke`: one that adds attention parameters and one that adds router rows."""


@dataclass(frozen=True)
class Settings:
    """The model, the recipe and the protocol every variant shares."""

    hidden_size: int = 128
    intermediate_size: int = 384
    """Width of the dense MLP of the first `first_k_dense_replace` blocks."""
    moe_intermediate_size: int = 64
    """Width of one routed (and the shared) expert's SwiGLU."""
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    seq_len: int = 256
    batch_tokens: int = 4096
    micro_batch_tokens: int = 2048
    warmup: int = 4
    """Optimizer steps left out of the tokens/s (the first steps pay for allocation); they do train."""
    steps: int = 96
    """Optimizer steps whose tokens/s count; a run trains warmup + steps steps."""
    lr: float = 3e-3
    weight_decay: float = 0.1
    balance_coeff: float = 1e-2
    """`model.moe_balance.coeff`: the selection bias's step per optimizer step."""
    balance_freeze_at: float = 0.9
    seeds: tuple[int, ...] = (0, 1, 2)
    """Each seed is one run per variant: its `model.init.seed` and `data.seed`."""
    threads: int = 1
    """Torch threads of each run."""
    jobs: int = 2
    """Runs at a time."""
    timeout_s: float = 900.0
    """Seconds a run may take before it is killed (and the benchmark stopped)."""

    @property
    def max_steps(self) -> int:
        """Optimizer steps of a run."""
        return self.warmup + self.steps

    def option_flags(self, variant: str) -> list[str]:
        """The flags of `variant` over the baseline (none for the baseline), placeholders filled for this size."""
        if variant == BASELINE:
            return []
        return [flag.format(half_hidden=self.hidden_size // 2) for flag in OPTIONS[variant]]

    @property
    def val_key(self) -> str:
        """The metric of the final held-out loss."""
        return f"val/heldout/loss@{self.seq_len}"

    def config(self, data_dir: Path, output_dir: Path) -> TrainConfig:
        """The config every run of every variant starts from (the seed and the option come as flags)."""
        return TrainConfig.model_validate(
            {
                "max_steps": self.max_steps,
                "output_dir": str(output_dir),
                "tokenizer": {"name": str(data_dir / "tokenizer")},
                "model": {
                    "param_dtype": "float32",
                    "compile": False,
                    "arch": {
                        "model_type": "glm4_moe",
                        "hidden_size": self.hidden_size,
                        "intermediate_size": self.intermediate_size,
                        "moe_intermediate_size": self.moe_intermediate_size,
                        "n_routed_experts": self.n_routed_experts,
                        "num_experts_per_tok": self.top_k,
                        "n_shared_experts": self.n_shared_experts,
                        "first_k_dense_replace": self.first_k_dense_replace,
                        "num_hidden_layers": self.num_hidden_layers,
                        "num_attention_heads": self.num_attention_heads,
                        "max_position_embeddings": self.seq_len,
                    },
                    "moe_balance": {"coeff": self.balance_coeff, "freeze_at": self.balance_freeze_at},
                },
                "data": {
                    "type": "tokens",
                    "paths": [str(data_dir / "train")],
                    "seq_len": self.seq_len,
                    "batch_tokens": self.batch_tokens,
                    "micro_batch_tokens": self.micro_batch_tokens,
                    "document_masking": True,
                },
                "optim": {"type": "muon", "lr": self.lr, "weight_decay": self.weight_decay},
                "schedule": {"warmup": 0.05, "decay": 0.3},
                "val": {"sets": [{"name": "heldout", "path": str(data_dir / "heldout")}], "eval_on_end": True},
                "ckpt": {"final": False},
                "log": {"interval": 1},
            }
        )


SMOKE = replace(
    Settings(),
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_hidden_layers=2,
    batch_tokens=1024,
    micro_batch_tokens=512,
    warmup=2,
    steps=6,
    seeds=(0,),
    timeout_s=240.0,
)
"""d64 x 2 blocks (one MoE block of 4 experts), 8 steps of 1,024 tokens: a check that the script runs."""


# ---------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Run:
    """One training: a variant at a seed."""

    variant: str
    seed: int

    @property
    def name(self) -> str:
        """Folder and label of the run."""
        return f"{self.variant}-seed{self.seed}"


def flags(run: Run, s: Settings) -> list[str]:
    """The `lmforge train` flags of a run on top of the shared config: its seed, then its option's flags."""
    return [f"--model.init.seed={run.seed}", f"--data.seed={run.seed}", *s.option_flags(run.variant)]


def flag_fields(option: Sequence[str]) -> set[str]:
    """The dotted config fields that `--section.field=value` flags set, spelled as the config's errors name them
    (the command line takes dashes for underscores)."""
    return {flag.removeprefix("--").split("=", 1)[0].replace("-", "_") for flag in option}


def only_unknown_fields(error: ConfigError, fields: set[str]) -> bool:
    """Whether every problem `error` lists is one of `fields` being unknown to the config: the option is not in
    this checkout yet, rather than set wrong."""
    problems = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
    return bool(problems) and all(
        any(p.startswith(f"{field} (from ") and "): unknown field" in p for field in fields) for p in problems
    )


def check_configs(base: Path, variants: Sequence[str], requested: set[str], s: Settings) -> dict[str, str]:
    """Validate every variant's config as `lmforge train` would. A variant the user did not name in `--options`
    whose flags the config does not know (an option not yet in this checkout) is skipped: returns those variants,
    each with the config's error. Any other failing config exits with the config's error."""
    skipped = {}
    for variant in variants:
        option = s.option_flags(variant)
        try:
            load_train_config(["@", str(base), *flags(Run(variant, 0), s)], 1)
        except ConfigError as e:
            if variant != BASELINE and variant not in requested and only_unknown_fields(e, flag_fields(option)):
                skipped[variant] = str(e)
                continue
            sys.exit(
                f"moe_options.py: the config of variant {variant!r} ({' '.join(option) or 'no flags'}) fails:\n{e}"
            )
    return skipped


def train(run: Run, base: Path, work: Path, s: Settings) -> dict[str, Any]:
    """Train one run through the command line and read its figures from its metrics.jsonl; a run that fails comes
    back with `error` (what went wrong and the end of its log)."""
    out = work / run.name
    cmd = [sys.executable, "-m", "lmforge", "train", "@", str(base), *flags(run, s), f"--output-dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}
    head = {"variant": run.variant, "seed": run.seed, "flags": flags(run, s)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=s.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {**head, "error": f"timed out after {s.timeout_s:.0f} s: {' '.join(cmd)}"}
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        log = (done.stdout + done.stderr)[-4000:]
        return {**head, "error": f"exit {done.returncode}: {' '.join(cmd)}\n{log}"}
    records = read_metrics(out / "metrics.jsonl")
    steps = sorted((r for r in records if "perf/throughput" in r), key=lambda r: r["step"])
    finals = [r[s.val_key] for r in records if s.val_key in r]
    params = next((r for r in records if r["step"] == 0 and any(k.startswith("params/") for k in r)), None)
    if len(steps) != s.max_steps or not finals or params is None:
        what = f"{len(steps)} of {s.max_steps} steps, {len(finals)} {s.val_key}, params {params is not None}"
        return {**head, "error": f"incomplete metrics.jsonl ({what}): {' '.join(cmd)}"}
    return {
        **head,
        "heldout_loss": finals[-1],
        "train_loss": steps[-1]["loss/mean"],
        "max_vio": steps[-1].get("max_vio/mean"),
        "step_tokens_per_s": [r["perf/throughput"] for r in steps],
        "params": {k.removeprefix("params/"): int(v) for k, v in params.items() if k.startswith("params/")},
        "wall_s": wall,
    }


def train_all(runs: Sequence[Run], base: Path, work: Path, s: Settings, say: Any) -> list[dict[str, Any]]:
    """Train `runs`, `s.jobs` at a time, in order. A failed option run is reported and the others go on; a failed
    baseline run (nothing left to compare with) cancels the runs not yet started and raises."""
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=s.jobs) as pool:
        pending: set[Future[dict[str, Any]]] = {pool.submit(train, run, base, work, s) for run in runs}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                if future.cancelled():
                    continue
                r = future.result()
                results.append(r)
                label = f"{r['variant']} seed {r['seed']}"
                if "error" not in r:
                    say(f"{label}: held-out loss {r['heldout_loss']:.4f} ({r['wall_s']:.0f} s)")
                    continue
                say(f"[red]{label} failed[/]: {escape(r['error'])}")
                if r["variant"] == BASELINE:
                    for other in pending:
                        other.cancel()
                    raise RuntimeError(f"the baseline run of seed {r['seed']} failed: {r['error']}")
    return sorted(results, key=lambda r: runs.index(Run(r["variant"], r["seed"])))


# ---------------------------------------------------------------------------------------------- report


def summarize(results: list[dict[str, Any]], variants: Sequence[str], s: Settings) -> list[dict[str, Any]]:
    """One row per variant: the held-out loss over the seeds, the tokens/s, the parameters, and each set against
    the baseline's. A variant with a failed run has `failed` (its error's first line) and no figures."""
    rows = []
    base_loss = {r["seed"]: r["heldout_loss"] for r in results if r["variant"] == BASELINE}
    for variant in variants:
        mine = [r for r in results if r["variant"] == variant]
        row: dict[str, Any] = {"variant": variant, "flags": s.option_flags(variant), "seeds": [r["seed"] for r in mine]}
        errors = [r["error"] for r in mine if "error" in r]
        if errors:
            rows.append({**row, "failed": errors[0].splitlines()[0]})
            continue
        losses = [r["heldout_loss"] for r in mine]
        timed = [t for r in mine for t in r["step_tokens_per_s"][s.warmup :]]
        vio = [r["max_vio"] for r in mine if r["max_vio"] is not None]
        rows.append(
            {
                **row,
                "heldout_losses": losses,
                "heldout_loss_mean": statistics.fmean(losses),
                "heldout_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "heldout_loss_min": min(losses),
                "heldout_loss_max": max(losses),
                # The same seed's baseline saw the same tokens in the same order: the paired differences.
                "seed_deltas": [r["heldout_loss"] - base_loss[r["seed"]] for r in mine],
                "train_loss_mean": statistics.fmean(r["train_loss"] for r in mine),
                "max_vio_mean": statistics.fmean(vio) if vio else None,
                "tokens_per_s": statistics.median(timed),
                "params": mine[0]["params"],
                "wall_s": [r["wall_s"] for r in mine],
            }
        )
    base = rows[0]
    for row in rows:
        if "failed" in row:
            continue
        row["delta_loss"] = row["heldout_loss_mean"] - base["heldout_loss_mean"]
        row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["params_delta"] = row["params"]["total"] - base["params"]["total"]
        # Bit-equal losses at every seed: the flag reached the config but changed nothing the model computes.
        row["same_as_baseline"] = row["variant"] != BASELINE and all(d == 0 for d in row["seed_deltas"])
    return rows


COLUMNS = ["variant", "held-out loss", "std", "Δ loss", "Δ per seed", "tokens/s", "speed", "params", "active non-emb",
           "max_vio"]  # fmt: skip
"""The columns of the table, rich and markdown alike: Δ is the option's figure minus the baseline's (negative:
lower loss than the baseline), speed the option's tokens/s over the baseline's."""


def cells(r: dict[str, Any]) -> list[str]:
    """One row of the table: the figures of a variant as text (against the baseline's for an option)."""
    if "failed" in r:
        return [r["variant"], "failed", "", "", "", "", "", "", "", ""]
    base = r["variant"] == BASELINE
    vio = r["max_vio_mean"]
    return [
        r["variant"],
        f"{r['heldout_loss_mean']:.4f}",
        f"{r['heldout_loss_std']:.4f}",
        "" if base else f"{r['delta_loss']:+.4f}",
        "" if base else " ".join(f"{d:+.3f}" for d in r["seed_deltas"]),
        f"{r['tokens_per_s']:,.0f}",
        "" if base else f"{r['speed_ratio']:.3f}x",
        f"{r['params']['total']:,}" + ("" if base else f" ({r['params_delta']:+,})"),
        f"{r['params'].get('active_non_embedding', 0):,}",
        "" if vio is None else f"{vio:.3f}",
    ]


def title(s: Settings) -> str:
    """What every run of the table trained."""
    return (
        f"glm4_moe research options: d{s.hidden_size} x {s.num_hidden_layers}, {s.n_routed_experts} experts top-"
        f"{s.top_k}, {s.max_steps * s.batch_tokens:,} tokens a run, seeds {' '.join(map(str, s.seeds))}, {s.jobs} "
        f"run(s) at a time of {s.threads} thread(s)"
    )


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table in markdown, as docs/benchmarks.md takes it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        row = cells(r)
        row[0] = f"`{row[0]}`"
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def print_report(
    rows: list[dict[str, Any]], s: Settings, skipped: dict[str, str], foreign: float, console: Any
) -> None:
    """The rich table of the variants, each option's flags, the notes, then the same table in markdown."""
    table = common.result_table(title(s), COLUMNS)
    for r in rows:
        table.add_row(*cells(r))
    console.print(table)
    for r in rows[1:]:
        console.print(f"  {r['variant']}: {' '.join(r['flags'])}", highlight=False)
    for r in rows:
        if "failed" in r:
            console.print(f"[red]{r['variant']} failed[/]: {escape(r['failed'])}")
        elif r["same_as_baseline"]:
            console.print(
                f"[yellow]{r['variant']}[/]: the same held-out loss as the baseline at every seed (the option "
                "changes nothing the model computes in this checkout)"
            )
    for variant, error in skipped.items():
        console.print(f"[yellow]{variant} skipped[/]: {escape(error.splitlines()[-1].strip())}")
    console.print(f"other processes used {foreign:.2f} cores on average while the benchmark ran", highlight=False)
    console.print("\nmarkdown:\n" + markdown_table(rows), highlight=False, markup=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    presets = {"default": Settings(), "smoke": SMOKE}
    smoke = f"tiny model, 8 steps, seed 0, baseline + {' and '.join(SMOKE_OPTIONS)}: checks the script runs"
    texts = {"steps": "timed optimizer steps per run", "warmup": "optimizer steps first, left out of tokens/s",
             "threads": "torch threads per run"}  # fmt: skip
    p = common.benchmark_parser(__doc__, presets, smoke, quiet_wait="before the runs", texts=texts)
    p.add_argument(
        "--options",
        nargs="+",
        choices=list(OPTIONS),
        default=None,
        metavar="NAME",
        help=f"options to run besides the baseline, from: {', '.join(OPTIONS)}\n"
        f"(default all; smoke {' '.join(SMOKE_OPTIONS)}); a named option whose flags the config\n"
        "does not know stops the script, an unnamed one is skipped",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2; smoke 0)")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default 2)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("data/demo"),
        help="demo data folder (tokenizer, train, heldout), built there if missing\n(default data/demo)",
    )
    return p.parse_args(argv)


def own_children_cpu_s() -> float:
    """CPU seconds of this process and of its finished child processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own_cpu_s() + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, validate every variant's config, train every run, print the table, write the JSON.
    Returns 1 when an option's run failed (its row says so), else 0."""
    args = parse_args(argv)
    s = common.with_flags(SMOKE if args.smoke else Settings(), args)
    s = replace(s, **{k: v for k, v in {"jobs": args.jobs, "seeds": args.seeds}.items() if v is not None})
    s = replace(s, seeds=tuple(dict.fromkeys(s.seeds)))
    if s.steps < 1 or s.warmup < 0 or s.threads < 1 or s.jobs < 1:
        print("moe_options.py: --steps, --threads and --jobs must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    requested = set(args.options or ())
    options = args.options or (list(SMOKE_OPTIONS) if args.smoke else list(OPTIONS))
    variants = [BASELINE, *dict.fromkeys(options)]
    console = common.make_console(width=140)
    data_dir = args.data_dir.resolve()
    prepare_demo_data(data_dir, console)
    with tempfile.TemporaryDirectory(prefix="lmforge-moe-options-") as tmp:
        work = Path(tmp)
        base = work / "run.toml"
        base.write_text(dump_toml(s.config(data_dir, work / "unused")), encoding="utf-8")
        skipped = check_configs(base, variants, requested, s)
        for variant, error in skipped.items():
            console.print(
                f"[yellow]skipping {variant}[/] ({' '.join(s.option_flags(variant))}): not in this checkout's config "
                f"({escape(error.splitlines()[-1].strip().split(' (known fields')[0])})"
            )
        variants = [v for v in variants if v not in skipped]
        settle(common.quiet_wait_s(args))
        runs = [Run(variant, seed) for seed in s.seeds for variant in variants]
        console.print(f"{len(runs)} runs of {s.max_steps} steps, {s.jobs} at a time", highlight=False)
        busy0, own0, t0 = cpu_busy_s(), own_children_cpu_s(), time.perf_counter()
        try:
            results = train_all(runs, base, work, s, lambda line: console.print(line, highlight=False))
        except RuntimeError as e:
            print(f"moe_options.py: {e}", file=sys.stderr)
            return 1
        wall = time.perf_counter() - t0
        foreign = max(cpu_busy_s() - busy0 - (own_children_cpu_s() - own0), 0.0) / wall
    rows = summarize(results, variants, s)
    print_report(rows, s, skipped, foreign, console)
    console.print(f"{len(runs)} runs in {wall / 60:.1f} min", highlight=False)
    bad = [r["variant"] for r in rows if "failed" not in r and not all(math.isfinite(x) for x in r["heldout_losses"])]
    if bad:
        console.print(f"[red]non-finite held-out loss:[/] {', '.join(bad)}")
    common.write_json(
        args.json,
        {
            "settings": asdict(s),
            "options": {v: s.option_flags(v) for v in variants[1:]},
            "skipped": skipped,
            "tokens_per_run": s.max_steps * s.batch_tokens,
            "rows": rows,
            "runs": results,
            "foreign_cores": foreign,
            "wall_s": wall,
        },
    )
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
