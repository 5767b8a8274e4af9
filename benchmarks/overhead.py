"""Overhead of lmforge's training loop against a hand-written PyTorch loop, eager and compiled, on the CPU.

All sides train the same Llama (same architecture, same initial weights) on the same fake micro-batches (the same
`FakeData` windows, split into the same micro-batches, document masking on), with the same AdamW hyper-parameters
and the same gradient clipping, in fp32 with the same number of threads:

- `lmforge` and `lmforge compiled`: a `Trainer` built from a `TrainConfig` in a process group of one (the parameter
  role groups, the step statistics, the background data prefetcher), with the default attention (`auto`: on the
  CPU, one causal SDPA per document segment, as here, unless a row holds very many short ones), and
  `model.compile` off or on. Each timed step is `trainer.data.next_step()` followed by `trainer.train_step(...)`:
  exactly what `Trainer.train` does per step, minus the metrics file and console (I/O, not loop overhead).
- `plain eager` and `plain compiled`: `plain_loop.py`, a loop written with torch alone, independent of lmforge's
  model and attention code (its own Llama, the fused causal SDPA kernel once per document segment), eager or with
  the whole model under `torch.compile` (the per-segment attention stays out of the graph, since the segments
  change with every micro-batch). Its weights are copied from an lmforge model at the start, so all sides start
  equal. Each timed step is `FakeData.next_step()` inline, then forward -> `F.cross_entropy(reduction="sum") /
  tokens` -> backward per micro-batch, `clip_grad_norm_`, `AdamW.step` (foreach), `zero_grad`, and one host read
  of the step's loss for the log line a researcher would print (lmforge also reads its step statistics once per
  step).

So every timed region holds the same work: building the step's micro-batches plus one optimizer step. lmforge is
set eager against eager and compiled against compiled.

Every side gets the same allocator: glibc's malloc settings change a CPU step's time by 20-28% here, and lmforge
sets them for itself (`lmforge.train.host_memory`). The timed runs are made twice, once with lmforge's setting for
every side (`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` in each side's environment, which lmforge then
leaves as they are) and once with glibc's defaults for every side (`LMFORGE_KEEP_FREED_MEMORY=0` for lmforge);
the report gives both.

Each side runs in its own spawned process, so its peak memory is its own: the peak resident set (`VmHWM`) is reset
after the imports and read after the last step, and the figure reported is the growth over that post-import
baseline. Each side runs `--repeats` times per allocator setting in alternating order and the best run counts. The
resident set also holds what the allocator keeps, so one more short run per side with `MALLOC_MMAP_THRESHOLD_` set
low (freed tensors go straight back to the OS) gives the live peak (`--no-live-memory` skips it). Targets, on equal
terms: lmforge eager >= 1.0x plain eager and lmforge compiled >= 0.95x plain compiled in tokens/s, and lmforge's
live peak <= 1.1x plain eager's. The eager losses agree with lmforge's to float rounding of the same operations;
compiled ones differ by the rounding of fused kernels; the report gives the largest difference per side.

The machine's speed also drifts by several percent over tens of seconds, more than the gap between the sides, so
two more spawned processes run each pair (lmforge eager and the plain eager loop, then both compiled) side by side,
one step of each in turn for `--interleaved` rounds (which goes first alternates), and report the ratio of their
median step times: a slowdown then falls on both alike. They run with the first allocator setting of
`--allocators`.

torch's thread pool is sized to the machine, so any other busy process stalls its barriers and can slow a step
several times over. Before each run the script waits (`--quiet-wait` seconds at most) for the CPUs to go idle, and
it reports the cores other processes used during each run's timed steps; a best run that shared the CPUs is
flagged as unreliable.

    .venv/bin/python benchmarks/overhead.py [--steps N] [--warmup N] [--repeats N] [--threads N] [--quiet-wait S]
                                            [--allocators lmforge,default] [--no-live-memory] [--interleaved N]
                                            [--json PATH]
    .venv/bin/python benchmarks/overhead.py --smoke      # tiny model, 2 steps (~60 s, most of it compiling)

The script always exits 0 when every side ran (it is a benchmark, not a test); PASS/MISS marks each target.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

import common
from cpu_load import ForeignLoad, settle
from lmforge.checkpoint.run_dir import prepare_output_dir
from lmforge.config import TrainConfig
from lmforge.config.checks import check_config
from lmforge.data.fake import FakeData
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.parallel.model_setup import padded_vocab_size
from lmforge.parallel.process_group import init_distributed, shutdown_distributed
from lmforge.train.trainer import Trainer
from plain_loop import Batch, LlamaShape, OptimSettings, PlainTrainer

SIDES = ("lmforge", "lmforge_compiled", "plain_eager", "plain_compiled")
PLAIN = SIDES[2:]
PAIRS = {"lmforge": "plain_eager", "lmforge_compiled": "plain_compiled"}
"""Each lmforge side and the plain side it is set against: eager against eager, compiled against compiled."""
THROUGHPUT_TARGETS = {"lmforge": 1.0, "lmforge_compiled": 0.95}
"""Each lmforge side's tokens/s must be at least this fraction of its plain side's."""
MEMORY_TARGET = 1.10
"""lmforge's live peak memory must be at most this multiple of the plain eager loop's."""
LABELS = {"lmforge": "lmforge", "lmforge_compiled": "lmforge compiled", "plain_eager": "plain eager",
          "plain_compiled": "plain compiled"}  # fmt: skip
ALLOCATORS, ALLOCATOR_LABELS = common.ALLOCATORS, common.ALLOCATOR_LABELS
INTERLEAVED_ROUNDS = 30
"""Rounds of the step-by-step comparison in one process (one lmforge and one plain eager step each)."""
FOREIGN_LIMIT = 0.1
"""Cores of foreign load above which a run's throughput is flagged as unreliable."""
MMAP_ENV, MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", "131072"
"""glibc: serve every block of 128 KiB or more with its own mmap, unmapped on free (this also turns off the dynamic
threshold), so the resident set tracks the tensors alive instead of what the allocator kept."""
MEMORY_PASS_STEPS = (1, 2)
"""(warmup, steps) of the live-memory runs: the peak is reached in the second step; fresh mmaps make them slow."""


@dataclass(frozen=True)
class Settings(common.TrainSettings):
    """Everything both sides share: the model, data and step counts of `TrainSettings`, AdamW's remaining
    hyper-parameters and gradient clipping (the plain loop sets them explicitly), the repeats and the threads."""

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_norm: float = 1.0
    repeats: int = 2
    """Runs per side, in alternating order; the best counts."""
    threads: int = 2

    def run_config(self, output_dir: str, compiled: bool = False) -> TrainConfig:
        """The lmforge config of the same run: fp32, the default attention (`auto`), the plain loop's AdamW, the
        blocks compiled or not."""
        optim = {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps, "max_norm": self.max_norm}
        return self.train_config(output_dir, model={"param_dtype": "float32", "compile": compiled}, optim=optim)


SMOKE = common.tiny(Settings, seq_len=128, batch_tokens=1024, micro_batch_tokens=256, mean_doc_len=256.0)
"""A model and batch small enough that a test can run the whole script in seconds."""


# ---------------------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    """A `/proc/self/status` figure in KiB (`VmHWM`, `VmRSS`), or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set to its current one; False where the kernel does not allow it.

    A spawned child inherits in `ru_maxrss` the high-water mark of the process it was forked from, so the peak is
    reset after the imports and each side's figure is its own.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_mib() -> float:
    """Resident set now, in MiB (0 where unknown)."""
    kib = _status_kib("VmRSS")
    return kib / 1024 if kib is not None else 0.0


def peak_rss_mib() -> float:
    """Peak resident set since the last reset (or since the start), in MiB."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib //= 1024 if sys.platform == "darwin" else 1  # bytes on macOS
    return kib / 1024


# ---------------------------------------------------------------------------------------------- the two sides


@contextlib.contextmanager
def lmforge_steps(settings: Settings, compiled: bool) -> Iterator[Callable[[], float]]:
    """lmforge's loop: a Trainer in a process group of one, stepped with its own data stream and `train_step`;
    yields a function that runs one step and returns its loss."""
    ctx = init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix="lmforge-overhead-") as tmp:
            config = settings.run_config(str(Path(tmp) / "run"), compiled)
            check_config(config, ctx.world_size)
            prepare_output_dir(config, overwrite=False)
            trainer = Trainer(config, ctx, console=False)

            def step() -> float:
                # The same two calls as Trainer.train per step; the metrics file/console are left out (I/O).
                t0 = time.perf_counter()
                micro_batches = trainer.data.next_step()
                return trainer.train_step(micro_batches, time.perf_counter() - t0)["loss/mean"]

            try:
                yield step
            finally:
                trainer.close()
    finally:
        shutdown_distributed()


def plain_steps(settings: Settings, compiled: bool) -> Callable[[], float]:
    """The loop a researcher writes by hand (`plain_loop.py`), no process group, no statistics beyond the loss: a
    function that runs one step and returns its loss."""
    # The same initial weights as lmforge's side: an lmforge model initialized from the same seed, copied in.
    arch, vocab = settings.llama_arch(), padded_vocab_size(settings.vocab_size)
    reference = build_model(arch, vocab, "auto", torch.device("cpu"))
    init_weights(reference, settings.init_std, settings.init_seed)
    shape = LlamaShape(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_layers=arch.num_hidden_layers,
        num_heads=arch.num_attention_heads,
        num_kv_heads=arch.kv_heads,
        vocab_size=vocab,
        max_seq_len=settings.seq_len,
        rope_theta=arch.rope_theta,
        norm_eps=arch.rms_norm_eps,
        tie_embeddings=arch.tie_word_embeddings,
    )
    optim = OptimSettings(
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        beta1=settings.beta1,
        beta2=settings.beta2,
        eps=settings.eps,
        max_norm=settings.max_norm,
    )
    trainer = PlainTrainer(shape, optim, compile=compiled, state_dict=reference.state_dict())
    del reference
    data = FakeData(settings.fake_data(), rank=0, world_size=1)

    def step() -> float:
        micro_batches = data.next_step()
        return trainer.step([Batch(mb.input_ids, mb.target_ids, mb.position_ids, mb.doc_lens) for mb in micro_batches])

    return step


def run_lmforge(settings: Settings, compiled: bool) -> common.Steps[float]:
    """Time lmforge's steps (`lmforge_steps`)."""
    with lmforge_steps(settings, compiled) as step:
        return common.timed_steps(settings.warmup, settings.steps, lambda _: step())


def run_plain(settings: Settings, compiled: bool) -> common.Steps[float]:
    """Time the plain loop's steps (`plain_steps`)."""
    step = plain_steps(settings, compiled)
    return common.timed_steps(settings.warmup, settings.steps, lambda _: step())


def measure_interleaved(settings: Settings, rounds: int, compiled: bool) -> dict[str, Any]:
    """lmforge and the plain loop, both eager or both compiled, in this (spawned) process, one step of each in turn
    for `rounds` rounds (which goes first alternates), after `settings.warmup` steps of each: a slowdown of the
    machine that lasts seconds falls on both sides alike. Returns the median step times and their ratio."""
    torch.set_num_threads(settings.threads)
    ours = "lmforge_compiled" if compiled else "lmforge"
    theirs = PAIRS[ours]
    times: dict[str, list[float]] = {ours: [], theirs: []}
    with lmforge_steps(settings, compiled) as lmforge_step:
        steps = {ours: lmforge_step, theirs: plain_steps(settings, compiled)}
        for _ in range(settings.warmup):
            for step in steps.values():
                step()
        load = ForeignLoad()
        load.start()
        for r in range(rounds):
            for side in common.in_turn(list(steps), r):
                t0 = time.perf_counter()
                steps[side]()
                times[side].append(time.perf_counter() - t0)
    medians = {side: statistics.median(ts) for side, ts in times.items()}
    return {"rounds": rounds, "median_step_s": medians, "ratio": medians[theirs] / medians[ours],
            "foreign_cores": load.cores(sum(sum(ts) for ts in times.values()))}  # fmt: skip


def measure_side(side: str, settings: Settings) -> dict[str, Any]:
    """Run one side in this (spawned) process and return its figures."""
    torch.set_num_threads(settings.threads)
    baseline = current_rss_mib()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    compiled = side.endswith("compiled")
    timing = run_lmforge(settings, compiled) if side.startswith("lmforge") else run_plain(settings, compiled)
    peak = peak_rss_mib()
    seconds = timing.seconds
    return {
        "side": side,
        "tokens_per_s": settings.steps * settings.batch_tokens / sum(seconds),
        "step_s_median": sorted(seconds)[len(seconds) // 2],
        "peak_rss_mib": peak,
        "baseline_rss_mib": baseline,
        # Without a reset, the peak includes the imports; the growth is then only an upper bound.
        "peak_mib": peak - baseline,
        "peak_reset": reset,
        "losses": timing.results,
        "foreign_cores": timing.foreign_cores,
        "wall_s": time.perf_counter() - t0,
        "threads": torch.get_num_threads(),
    }


def run_side(side: str, settings: Settings, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one side in a fresh spawned process (with `env` added to its environment) and return its figures."""
    result = common.run_in_child(measure_side, (side, settings), f"overhead-{side}", env)
    return common.raise_for_error(result, f"the {side} side")


# ---------------------------------------------------------------------------------------------- report


def summarize(runs: list[dict[str, Any]], memory_runs: list[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """Per allocator setting, the best run of each side (highest tokens/s, lowest peak) and each lmforge side's
    ratio to its plain side; the live peaks and their ratio; the target verdicts and the loss agreement."""
    best: dict[str, dict[str, dict[str, float]]] = {}
    ratios: dict[str, dict[str, float]] = {}
    verdicts: dict[str, dict[str, bool]] = {}
    for allocator in sorted({r["allocator"] for r in runs}, key=list(ALLOCATORS).index):
        best[allocator] = {}
        for side in SIDES:
            mine = [r for r in runs if r["side"] == side and r["allocator"] == allocator]
            fastest = max(mine, key=lambda r: r["tokens_per_s"])
            best[allocator][side] = {
                "tokens_per_s": fastest["tokens_per_s"],
                "foreign_cores": fastest["foreign_cores"],
                "peak_mib": min(r["peak_mib"] for r in mine),
            }
        ratios[allocator] = {ours: best[allocator][ours]["tokens_per_s"] / best[allocator][theirs]["tokens_per_s"]
                             for ours, theirs in PAIRS.items()}  # fmt: skip
        verdicts[allocator] = {ours: ratios[allocator][ours] >= THROUGHPUT_TARGETS[ours] for ours in PAIRS}
    live = {r["side"]: r["peak_mib"] for r in memory_runs}
    live_ratio = live["lmforge"] / live["plain_eager"] if {"lmforge", "plain_eager"} <= live.keys() else math.nan
    # Same init and data: the first step's loss (before any update) must agree; later ones to float tolerance
    # (eager: the same operations; compiled: fused kernels round differently).
    first = {s: next(r for r in runs if r["side"] == s)["losses"] for s in SIDES}
    loss_diff = {p: max(abs(a - b) for a, b in zip(first["lmforge"], first[p], strict=True)) for p in SIDES[1:]}
    return {
        "settings": asdict(settings),
        "runs": runs,
        "memory_runs": memory_runs,
        "best": best,
        "ratios": ratios,
        "verdicts": verdicts,
        "live_peak_mib": live,
        "live_ratio": live_ratio,
        "live_verdict": live_ratio <= MEMORY_TARGET if memory_runs else None,
        "first_loss": {s: losses[0] for s, losses in first.items()},
        "max_loss_diff": loss_diff,
    }


def print_report(summary: dict[str, Any], console: Console) -> None:
    """The table: each side's best tokens/s under each allocator setting with lmforge's ratios and the targets,
    then the live peaks."""
    s = Settings(**summary["settings"])
    allocators = list(summary["best"])
    title = (
        f"lmforge vs plain PyTorch: Llama d{s.hidden_size} x{s.num_hidden_layers}, seq {s.seq_len}, "
        f"{s.batch_tokens} tokens/step in {s.batch_tokens // s.micro_batch_tokens} micro-batches, fp32, "
        f"{s.threads} threads, {s.steps} timed steps after {s.warmup}"
    )
    table = common.result_table(title, ["side", *(f"tokens/s\n{ALLOCATOR_LABELS[a]}" for a in allocators)])
    for side in SIDES:
        table.add_row(LABELS[side], *(f"{summary['best'][a][side]['tokens_per_s']:,.0f}" for a in allocators))
    table.add_section()
    for ours, theirs in PAIRS.items():
        cells = [f"{summary['ratios'][a][ours]:.3f}x {common.verdict(summary['verdicts'][a][ours])}"
                 for a in allocators]  # fmt: skip
        table.add_row(f"{LABELS[ours]} / {LABELS[theirs]}", *cells)
    table.add_row("target", *(" / ".join(f">= {t:.2f}x" for t in THROUGHPUT_TARGETS.values()) for _ in allocators))
    console.print(table)
    for ours, mixed in (summary.get("interleaved") or {}).items():
        theirs = PAIRS[ours]
        ms = mixed["median_step_s"]
        console.print(
            f"{LABELS[ours]} and {LABELS[theirs]} step by step in one process ({mixed['rounds']} rounds, "
            f"{ALLOCATOR_LABELS[mixed['allocator']]}): median step {ms[ours] * 1e3:.1f} ms against "
            f"{ms[theirs] * 1e3:.1f} ms; {mixed['ratio']:.3f}x "
            f"{common.verdict(mixed['ratio'] >= THROUGHPUT_TARGETS[ours])} (target >= {THROUGHPUT_TARGETS[ours]:.2f}x)",
            highlight=False,
        )
    live = summary["live_peak_mib"]
    if live:
        peaks = ", ".join(f"{LABELS[side]} {mib:,.1f} MiB" for side, mib in live.items())
        console.print(
            "live peak (RSS growth over the imports, freed tensors returned to the OS with "
            f"{MMAP_ENV}={MMAP_THRESHOLD}): {peaks}"
            + f"; lmforge / plain eager {summary['live_ratio']:.3f}x {common.verdict(summary['live_verdict'])} "
            f"(target <= {MEMORY_TARGET:.2f}x)",
            highlight=False,
        )
    first, diff = summary["first_loss"], summary["max_loss_diff"]
    console.print(
        "same model and data: first-step loss "
        + ", ".join(f"{LABELS[side]} {first[side]:.6f}" for side in SIDES)
        + "; largest loss difference to lmforge over all steps: "
        + ", ".join(f"{LABELS[p]} {diff[p]:.2e}" for p in SIDES[1:]),
        highlight=False,
    )
    contended = sorted({f"{LABELS[side]} ({a})" for a in allocators for side in SIDES
                        if summary["best"][a][side]["foreign_cores"] > FOREIGN_LIMIT})  # fmt: skip
    if contended:
        console.print(
            f"[yellow]other processes used the CPUs during the best {', '.join(contended)} run "
            f"(> {FOREIGN_LIMIT} cores): the throughput figures are not reliable; rerun on an idle machine[/]"
        )
    if not all(r.get("peak_reset", True) for r in summary["runs"] + summary["memory_runs"]):
        console.print("[yellow]could not reset the peak RSS: memory figures include the imports[/]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset step counts take the defaults of the chosen size."""
    smoke = "tiny model and 2 steps: checks the script runs (~30 s, most of it compiling the plain loop)"
    presets = {"default": Settings(), "smoke": SMOKE}
    p = common.benchmark_parser(__doc__, presets, smoke, quiet_wait="before each run", all_cores=True)
    p.add_argument(
        "--allocators",
        default=",".join(ALLOCATORS),
        help="the allocator settings every side runs with in turn: lmforge (its malloc thresholds), default (glibc's)",
    )
    p.add_argument(
        "--interleaved",
        type=int,
        default=None,
        metavar="ROUNDS",
        help="rounds of the step-by-step comparisons of lmforge and the plain loop in one process, eager and compiled "
        "(default 30, smoke 3; 0 skips them)",
    )
    p.add_argument(
        "--no-live-memory",
        action="store_true",
        help=f"skip the extra runs (one per side) that measure the live peak with {MMAP_ENV}",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every side, print the table, optionally write the JSON; 0 unless a side failed to run."""
    args = parse_args(argv)
    settings = common.with_flags(SMOKE if args.smoke else Settings(), args)
    quiet_wait = common.quiet_wait_s(args)
    if settings.steps < 1 or settings.warmup < 0 or settings.repeats < 1 or settings.threads < 1:
        print("overhead.py: --steps, --repeats and --threads must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    try:
        allocators = common.allocator_names(args.allocators)
    except ValueError as e:
        print(f"overhead.py: --allocators: {e}", file=sys.stderr)
        return 2
    console = common.make_console()
    runs: list[dict[str, Any]] = []
    for allocator in allocators:
        for r in range(settings.repeats):
            for side in common.in_turn(SIDES, r):
                settle(quiet_wait)
                result = {**run_side(side, settings, ALLOCATORS[allocator]), "allocator": allocator}
                console.print(
                    f"{allocator:>7} run {r + 1}/{settings.repeats} {LABELS[side]:>16}: "
                    f"{result['tokens_per_s']:,.0f} tokens/s, peak +{result['peak_mib']:,.1f} MiB, other processes "
                    f"{result['foreign_cores']:.2f} cores ({result['wall_s']:.1f} s)",
                    highlight=False,
                )
                runs.append(result)
    memory_runs: list[dict[str, Any]] = []
    if not args.no_live_memory:
        warmup, steps = MEMORY_PASS_STEPS
        for side in ("lmforge", "plain_eager"):
            result = run_side(side, replace(settings, warmup=warmup, steps=steps), {MMAP_ENV: MMAP_THRESHOLD})
            console.print(f"live-memory run {LABELS[side]:>14}: peak +{result['peak_mib']:,.1f} MiB", highlight=False)
            memory_runs.append(result)
    rounds = args.interleaved if args.interleaved is not None else (3 if args.smoke else INTERLEAVED_ROUNDS)
    interleaved: dict[str, Any] = {}
    for ours in PAIRS if rounds > 0 else ():
        settle(quiet_wait)
        result = common.run_in_child(measure_interleaved, (settings, rounds, ours == "lmforge_compiled"),
                                     f"overhead-interleaved-{ours}", ALLOCATORS[allocators[0]])  # fmt: skip
        interleaved[ours] = {**common.raise_for_error(result, f"the interleaved {ours} run"),
                             "allocator": allocators[0]}  # fmt: skip
    summary = summarize(runs, memory_runs, settings)
    summary["interleaved"] = interleaved
    print_report(summary, console)
    common.write_json(args.json, summary)
    if not all(math.isfinite(d) for d in summary["max_loss_diff"].values()):
        console.print("[yellow]a loss was not finite[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
