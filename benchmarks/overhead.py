"""Overhead of lmforge's training loop against a minimal hand-written PyTorch loop, on the CPU.

Both sides train the same Llama (same architecture, same per-parameter init seeds) on the same fake micro-batches
(the same `FakeData` windows, split into the same micro-batches), with the same AdamW hyper-parameters and the same
gradient clipping, in fp32 with the same number of threads:

- `lmforge`: a `Trainer` built from a `TrainConfig` in a process group of one (FSDP2 over one rank, the parameter
  role groups, the step statistics, the background data prefetcher). Each timed step is
  `trainer.data.next_step()` followed by `trainer.train_step(...)`: exactly what `Trainer.train` does per step,
  minus the metrics file and console (I/O, not loop overhead).
- `plain`: no process group, no FSDP. Each timed step is `FakeData.next_step()` inline, then forward ->
  `F.cross_entropy(reduction="sum") / tokens` -> backward per micro-batch, `clip_grad_norm_`, `AdamW.step`
  (foreach), `zero_grad`, and one host read of the step's loss for the log line a researcher would print (lmforge
  also reads its step statistics once per step).

So both timed regions hold the same work: building the step's micro-batches plus one optimizer step.

Each side runs in its own spawned process, so its peak memory is its own: the peak resident set (`VmHWM`) is reset
after the imports and read after the last step, and the figure reported is the growth over that post-import
baseline (the imports are identical on both sides). Each side runs `--repeats` times in alternating order and the
best run counts. glibc's malloc keeps freed blocks in the heap depending on the allocation history, so that figure
can differ by tens of MiB between two programs holding the same tensors; one more short run per side with
`MALLOC_MMAP_THRESHOLD_` set (freed tensors go straight back to the OS) gives the live peak as well
(`--no-live-memory` skips it). Targets: lmforge >= 0.95x plain tokens/s and <= 1.1x plain peak memory.

torch's thread pool is sized to the machine, so any other busy process stalls its barriers and can slow a step
several times over. Before each run the script waits (`--quiet-wait` seconds at most) for the CPUs to go idle, and
it reports the cores other processes used during each run's timed steps; a best run that shared the CPUs is
flagged as unreliable.

    .venv/bin/python benchmarks/overhead.py [--steps N] [--warmup N] [--repeats N] [--threads N] [--quiet-wait S]
                                            [--no-live-memory] [--json PATH]
    .venv/bin/python benchmarks/overhead.py --smoke      # tiny model, 2 steps (~20 s)

The script always exits 0 when both sides ran (it is a benchmark, not a test); PASS/MISS marks each target.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

import common
from cpu_load import settle
from lmforge.config import TrainConfig
from lmforge.config.checks import check_config
from lmforge.data.batch import MicroBatch
from lmforge.data.fake import FakeData
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.parallel import init_distributed, shutdown_distributed
from lmforge.runtime.model_setup import padded_vocab_size
from lmforge.runtime.run_dir import prepare_output_dir
from lmforge.train.trainer import Trainer

THROUGHPUT_TARGET = 0.95
"""lmforge tokens/s must be at least this fraction of the plain loop's."""
MEMORY_TARGET = 1.10
"""lmforge peak memory must be at most this multiple of the plain loop's."""
SIDES = ("lmforge", "plain")
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

    def run_config(self, output_dir: str) -> TrainConfig:
        """The lmforge config of the same run, fp32 with the same attention and AdamW settings as the plain loop."""
        optim = {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps, "max_norm": self.max_norm}
        return self.train_config(output_dir, model={"attn": "sdpa", "param_dtype": "float32"}, optim=optim)


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


def run_lmforge(settings: Settings) -> common.Steps[float]:
    """lmforge's loop: a Trainer in a process group of one, stepped with its own data stream and `train_step`."""
    ctx = init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix="lmforge-overhead-") as tmp:
            config = settings.run_config(str(Path(tmp) / "run"))
            check_config(config, ctx.world_size)
            prepare_output_dir(config, overwrite=False)
            trainer = Trainer(config, ctx, console=False)

            def step() -> float:
                # The same two calls as Trainer.train per step; the metrics file/console are left out (I/O).
                t0 = time.perf_counter()
                micro_batches = trainer.data.next_step()
                return trainer.train_step(micro_batches, time.perf_counter() - t0)["loss/mean"]

            try:
                return common.timed_steps(settings.warmup, settings.steps, lambda _: step())
            finally:
                trainer.close()
    finally:
        shutdown_distributed()


def run_plain(settings: Settings) -> common.Steps[float]:
    """The loop a researcher writes by hand: no process group, no FSDP, no statistics beyond the loss."""
    model = build_model(settings.llama_arch(), padded_vocab_size(settings.vocab_size), "sdpa", torch.device("cpu"))
    init_weights(model, settings.init_std, settings.init_seed)
    # nanoGPT-style groups: matrices and embeddings decay, norm scales do not (lmforge's roles decide the same).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        eps=settings.eps,
        foreach=True,
    )
    data = FakeData(settings.fake_data(), rank=0, world_size=1)

    def forward_backward(mb: MicroBatch, n_tokens: int) -> torch.Tensor:
        logits = model(mb["input_ids"], mb["position_ids"], mb["seq_lens"])
        loss = F.cross_entropy(logits.flatten(0, 1), mb["target_ids"].flatten(), reduction="sum")
        (loss / n_tokens).backward()
        return loss.detach()

    def step() -> float:
        micro_batches = data.next_step()
        n_tokens = sum(mb["input_ids"].numel() for mb in micro_batches)
        loss_sum = sum(forward_backward(mb, n_tokens) for mb in micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss_sum) / n_tokens

    return common.timed_steps(settings.warmup, settings.steps, lambda _: step())


def measure_side(side: str, settings: Settings) -> dict[str, Any]:
    """Run one side in this (spawned) process and return its figures."""
    torch.set_num_threads(settings.threads)
    baseline = current_rss_mib()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    timing = (run_lmforge if side == "lmforge" else run_plain)(settings)
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
    """Best run per side (highest tokens/s, lowest peaks), the lmforge/plain ratios and the target verdicts."""
    best: dict[str, dict[str, float]] = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        fastest = max(mine, key=lambda r: r["tokens_per_s"])
        live = [r["peak_mib"] for r in memory_runs if r["side"] == side]
        best[side] = {
            "tokens_per_s": fastest["tokens_per_s"],
            "foreign_cores": fastest["foreign_cores"],
            "peak_mib": min(r["peak_mib"] for r in mine),
            "peak_rss_mib": min(r["peak_rss_mib"] for r in mine),
            "live_peak_mib": min(live) if live else math.nan,
        }
    ratios = {
        "throughput": best["lmforge"]["tokens_per_s"] / best["plain"]["tokens_per_s"],
        "memory": best["lmforge"]["peak_mib"] / best["plain"]["peak_mib"],
        "live_memory": best["lmforge"]["live_peak_mib"] / best["plain"]["live_peak_mib"],
    }
    # Same init and data: the first step's loss (before any update) must agree; later ones to float tolerance.
    first = [next(r for r in runs if r["side"] == s)["losses"] for s in SIDES]
    loss_diff = max(abs(a - b) for a, b in zip(*first, strict=True))
    return {
        "settings": asdict(settings),
        "runs": runs,
        "memory_runs": memory_runs,
        "best": best,
        "throughput_ratio": ratios["throughput"],
        "memory_ratio": ratios["memory"],
        "live_memory_ratio": ratios["live_memory"],
        "throughput_pass": ratios["throughput"] >= THROUGHPUT_TARGET,
        "memory_pass": ratios["memory"] <= MEMORY_TARGET,
        "live_memory_pass": ratios["live_memory"] <= MEMORY_TARGET if memory_runs else None,
        "first_loss": {s: first[i][0] for i, s in enumerate(SIDES)},
        "max_loss_diff": loss_diff,
    }


def print_report(summary: dict[str, Any], console: Console) -> None:
    """The table: each side's best tokens/s and peak memory, then the ratios against the targets."""
    s = Settings(**summary["settings"])
    best = summary["best"]
    live = summary["memory_runs"] != []
    title = (
        f"lmforge vs plain PyTorch: Llama d{s.hidden_size} x{s.num_hidden_layers}, seq {s.seq_len}, "
        f"{s.batch_tokens} tokens/step in {s.batch_tokens // s.micro_batch_tokens} micro-batches, fp32, "
        f"{s.threads} threads, {s.steps} timed steps after {s.warmup}"
    )
    live_column = ["live peak MiB\n(RSS, freed returned)"] if live else []
    columns = ["side", "tokens/s", "peak memory MiB\n(RSS growth)", *live_column, "process peak\nRSS MiB"]
    table = common.result_table(title, columns)
    for side in SIDES:
        b = best[side]
        cells = [f"{b['tokens_per_s']:,.0f}", f"{b['peak_mib']:,.1f}"]
        cells += [f"{b['live_peak_mib']:,.1f}"] if live else []
        table.add_row(side, *cells, f"{b['peak_rss_mib']:,.1f}")
    table.add_section()
    cells = [
        f"{summary['throughput_ratio']:.3f}x {common.verdict(summary['throughput_pass'])}",
        f"{summary['memory_ratio']:.3f}x {common.verdict(summary['memory_pass'])}",
    ]
    cells += [f"{summary['live_memory_ratio']:.3f}x {common.verdict(summary['live_memory_pass'])}"] if live else []
    table.add_row("lmforge / plain", *cells, "")
    targets = [f">= {THROUGHPUT_TARGET:.2f}x", f"<= {MEMORY_TARGET:.2f}x"] + (
        [f"<= {MEMORY_TARGET:.2f}x"] if live else []
    )
    table.add_row("target", *targets, "")
    console.print(table)
    console.print(
        "peak memory: growth of the peak resident set over the post-import baseline, each side in its own process, "
        "with glibc's default malloc (which keeps freed blocks depending on the allocation history)."
    )
    if live:
        console.print(
            f"live peak: the same, in one more run per side ({MEMORY_PASS_STEPS[0]} warmup + {MEMORY_PASS_STEPS[1]} "
            f"steps) with {MMAP_ENV}={MMAP_THRESHOLD}, so "
            "freed tensors go back to the OS and the peak follows the memory actually in use."
        )
    console.print(
        f"same model and data: first-step loss lmforge {summary['first_loss']['lmforge']:.6f}, "
        f"plain {summary['first_loss']['plain']:.6f}; largest loss difference over all steps "
        f"{summary['max_loss_diff']:.2e}"
    )
    contended = [side for side in SIDES if best[side]["foreign_cores"] > FOREIGN_LIMIT]
    if contended:
        console.print(
            f"[yellow]other processes used the CPUs during the best {' and '.join(contended)} run "
            f"(> {FOREIGN_LIMIT} cores): the throughput figures are not reliable; rerun on an idle machine[/]"
        )
    if not all(r.get("peak_reset", True) for r in summary["runs"] + summary["memory_runs"]):
        console.print("[yellow]could not reset the peak RSS: memory figures include the imports[/]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset step counts take the defaults of the chosen size."""
    smoke = "tiny model and 2 steps: checks the script runs (~20 s)"
    presets = {"default": Settings(), "smoke": SMOKE}
    p = common.benchmark_parser(__doc__, presets, smoke, quiet_wait="before each run", all_cores=True)
    p.add_argument(
        "--no-live-memory",
        action="store_true",
        help=f"skip the extra runs (one per side) that measure the live peak with {MMAP_ENV}",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run both sides, print the table, optionally write the JSON; 0 unless a side failed to run."""
    args = parse_args(argv)
    settings = common.with_flags(SMOKE if args.smoke else Settings(), args)
    quiet_wait = common.quiet_wait_s(args)
    if settings.steps < 1 or settings.warmup < 0 or settings.repeats < 1 or settings.threads < 1:
        print("overhead.py: --steps, --repeats and --threads must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    console = common.make_console()
    runs: list[dict[str, Any]] = []
    for r in range(settings.repeats):
        for side in common.in_turn(SIDES, r):
            settle(quiet_wait)
            result = run_side(side, settings)
            console.print(
                f"run {r + 1}/{settings.repeats} {side:>7}: {result['tokens_per_s']:,.0f} tokens/s, "
                f"peak +{result['peak_mib']:,.1f} MiB, other processes {result['foreign_cores']:.2f} cores "
                f"({result['wall_s']:.1f} s)",
                highlight=False,
            )
            runs.append(result)
    memory_runs: list[dict[str, Any]] = []
    if not args.no_live_memory:
        warmup, steps = MEMORY_PASS_STEPS
        for side in SIDES:
            result = run_side(side, replace(settings, warmup=warmup, steps=steps), {MMAP_ENV: MMAP_THRESHOLD})
            console.print(f"live-memory run {side:>7}: peak +{result['peak_mib']:,.1f} MiB", highlight=False)
            memory_runs.append(result)
    summary = summarize(runs, memory_runs, settings)
    print_report(summary, console)
    common.write_json(args.json, summary)
    if not math.isfinite(summary["max_loss_diff"]):
        console.print("[yellow]a loss was not finite[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
