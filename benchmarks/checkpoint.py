"""Save and load cost of lmforge's sharded checkpoints (`lmforge.checkpoint.checkpointer`), on the CPU.

The script builds a Llama (default: hidden 768, 12 layers, intermediate 2048, 12 heads, vocabulary 32,000, untied
LM head: 134M parameters, printed exactly) in fp32 with lmforge's AdamW (one group per parameter role), in a
process group of one (`init_distributed` without torchrun, `parallelize` as the trainer does). One optimizer step
on random gradients fills the AdamW state (`exp_avg`, `exp_avg_sq`, `step`), so a checkpoint holds what a real one
holds: the weights, two moments per weight, the RNG states and the trainer state. Then, `--repeats` times each
(the best figure counts), every save into a run folder of its own:

- `sync`: `Checkpointer.save` with `ckpt.async = false`. The caller is blocked until the checkpoint is written
  (DCP fsyncs its files) and committed (renamed to `step_N`, `latest` updated): blocked = total.
- `async`: `Checkpointer.save` with `ckpt.async = true`. blocked is what `save` returns (the state is staged into
  host memory, then the files are written by a background thread); total runs until `wait()` has committed the
  checkpoint, with the caller idle meanwhile.
- `load`: `load_checkpoint` of the sync checkpoint into a freshly built model and optimizer (as a resume does);
  the loaded parameters and optimizer state are then compared, exactly, with those of the model that was saved
  ("verified"). The files were just written, so they are read from the page cache.

bytes is the size of the committed checkpoint folder (all its files); MB/s is bytes / total seconds (10^6 bytes).
One more async save, not counted in the table, shows that the caller keeps working while the files are written: it
runs 512 x 512 matmuls (a stand-in for training steps) and calls `Checkpointer.poll()` between them, as the trainer
does every step, until the checkpoint is committed; their rate is compared with the rate with no save going on.

Checkpoints go to a temporary folder, made under `--dir` (to choose the file system) or the system's temporary
folder, and removed at the end. Before each measurement the script waits (`--quiet-wait` seconds at most) for the
CPUs to go idle, and it reports the cores other processes used during each one.

    .venv/bin/python benchmarks/checkpoint.py [--repeats N] [--dir DIR] [--threads N] [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/checkpoint.py --smoke      # tiny model, one repeat (a few seconds)

The script always exits 0 when it ran (it is a benchmark, not a test); the table says whether the load verified.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

import common
from cpu_load import ForeignLoad, settle
from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.checkpoint.layout import CHECKPOINTS, list_checkpoints, step_name
from lmforge.checkpoint.load import load_checkpoint
from lmforge.config.ckpt import CkptConfig
from lmforge.config.model import ModelConfig
from lmforge.config.optim import AdamWConfig
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.optim import build_optimizer
from lmforge.parallel.fsdp import parallelize
from lmforge.parallel.model_setup import padded_vocab_size
from lmforge.parallel.process_group import DistContext, init_distributed, shutdown_distributed

MODES = ("sync", "async", "load")
FOREIGN_LIMIT = 0.1
"""Cores of foreign load above which a measurement is flagged as unreliable."""
WORK_SIZE = 512
"""Side of the square fp32 matmuls the caller runs while an async save writes."""
TRAINER_STATE = {"tokens_seen": 0, "schedule_start": 0}
"""What the trainer passes to `save` besides the step (the data position is left out: no data stream here)."""


@dataclass(frozen=True)
class Settings(common.ModelSettings):
    """The model and optimizer checkpointed; `init_seed` also seeds the random gradients of the one step."""

    seq_len: int = 4096
    """Only the model's position range: nothing is trained here (4096 is `LlamaArch`'s default)."""
    lr: float = 1e-3
    repeats: int = 3
    """Measurements per mode; the best counts."""
    threads: int = 2


FULL = Settings(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, vocab_size=32_000
)
"""The default: a 134M-parameter Llama with an untied LM head, the size of a small pretraining run."""

SMOKE = common.tiny(Settings, vocab_size=256)
"""A model small enough that a test can run the whole script in seconds."""


# ---------------------------------------------------------------------------------------------- model


def build(settings: Settings, ctx: DistContext, init: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model and optimizer as the trainer builds them; `init=False` leaves the constructor's values (a resume)."""
    arch = settings.llama_arch()
    model = build_model(arch, padded_vocab_size(settings.vocab_size), "sdpa", ctx.device)
    if init:
        init_weights(model, settings.init_std, settings.init_seed)
    model = parallelize(model, model.blocks, ModelConfig(arch=arch, attn="sdpa", param_dtype="float32"), ctx)
    return model, build_optimizer(model, AdamWConfig(lr=settings.lr))


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on seeded random gradients: fills the optimizer state and moves every weight."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype).mul_(1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def same_state(model: nn.Module, optimizer: Any, ref_model: nn.Module, ref_optim: Any) -> bool:
    """Whether the parameters and optimizer state of one model/optimizer pair equal those of another, exactly."""
    params, ref_params = model.state_dict(), ref_model.state_dict()
    if params.keys() != ref_params.keys() or not all(torch.equal(params[k], ref_params[k]) for k in params):
        return False
    (adamw,), (ref_adamw,) = optimizer.optimizers, ref_optim.optimizers  # AdamWConfig: one torch optimizer
    state, ref_state = adamw.state_dict()["state"], ref_adamw.state_dict()["state"]
    if state.keys() != ref_state.keys() or not ref_state:
        return False
    for idx, entry in state.items():
        ref = ref_state[idx]
        if entry.keys() != ref.keys():
            return False
        for key, value in entry.items():
            equal = torch.equal(value, ref[key]) if isinstance(value, torch.Tensor) else value == ref[key]
            if not equal:
                return False
    return True


def folder_bytes(path: Path) -> int:
    """Sum of the sizes of every file under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------------- measurements


def measured(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `fn` and add to its figures the cores other processes kept busy meanwhile."""
    load, t0 = ForeignLoad(), time.perf_counter()
    result = fn()
    return {**result, "foreign_cores": load.cores(time.perf_counter() - t0)}


def save_once(
    run_dir: Path, async_save: bool, step: int, ctx: DistContext, model: nn.Module, optimizer: Any
) -> dict[str, Any]:
    """One checkpoint into a fresh run folder: seconds blocked, seconds until committed, bytes on disk."""
    ckpt = Checkpointer(run_dir, CkptConfig(async_save=async_save), ctx, {})
    try:

        def timed() -> dict[str, Any]:
            t0 = time.perf_counter()
            blocked = ckpt.save(step, model, optimizer, TRAINER_STATE)
            ckpt.wait()
            return {"blocked_s": blocked, "total_s": time.perf_counter() - t0}

        result = measured(timed)
    finally:
        ckpt.close()
    root = run_dir / CHECKPOINTS
    assert step in list_checkpoints(root), f"step {step} was not committed under {root}"
    return {**result, "bytes": folder_bytes(root / step_name(step))}


def load_once(path: Path, step: int, settings: Settings, ctx: DistContext, model: nn.Module, optimizer: Any) -> dict:
    """`load_checkpoint` into a freshly built model and optimizer, then compare them with the saved ones."""
    fresh_model, fresh_optim = build(settings, ctx, init=False)
    before = same_state(fresh_model, fresh_optim, model, optimizer)  # False: the fresh pair has other values

    def timed() -> dict[str, Any]:
        t0 = time.perf_counter()
        state = load_checkpoint(path, fresh_model, fresh_optim, ctx.rank)
        seconds = time.perf_counter() - t0
        return {"blocked_s": seconds, "total_s": seconds, "state": state}

    result = measured(timed)
    state = result.pop("state")
    verified = not before and state.get("step") == step and same_state(fresh_model, fresh_optim, model, optimizer)
    return {**result, "bytes": folder_bytes(path), "verified": verified}


def matmul_rate(seconds: float) -> float:
    """Matmuls per second of the work loop with nothing else going on."""
    a, b = torch.randn(WORK_SIZE, WORK_SIZE), torch.randn(WORK_SIZE, WORK_SIZE)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        count += 1
    return count / (time.perf_counter() - t0)


def save_while_working(run_dir: Path, step: int, ctx: DistContext, model: nn.Module, optimizer: Any) -> dict:
    """An async save during which the caller runs matmuls and polls the checkpointer until it has committed."""
    idle_rate = matmul_rate(0.5)
    a, b = torch.randn(WORK_SIZE, WORK_SIZE), torch.randn(WORK_SIZE, WORK_SIZE)
    root = run_dir / CHECKPOINTS
    ckpt = Checkpointer(run_dir, CkptConfig(async_save=True), ctx, {})
    try:
        t0 = time.perf_counter()
        blocked = ckpt.save(step, model, optimizer, TRAINER_STATE)
        t1 = time.perf_counter()
        count = 0
        while True:
            ckpt.poll()  # commits once the background write is done, as the trainer's loop does every step
            if step in list_checkpoints(root):
                break
            torch.mm(a, b)
            count += 1
        t2 = time.perf_counter()
    finally:
        ckpt.close()
    work_s = t2 - t1
    return {
        "blocked_s": blocked,
        "total_s": t2 - t0,
        "matmuls": count,
        "work_s": work_s,
        "matmuls_per_s": count / work_s if work_s > 0 else 0.0,
        "idle_matmuls_per_s": idle_rate,
    }


# ---------------------------------------------------------------------------------------------- report


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Best figures per mode: the lowest blocked and total seconds over the repeats, MB/s from the best total."""
    best = {}
    for mode, mine in runs.items():
        fastest = min(mine, key=lambda r: r["total_s"])
        best[mode] = {
            "blocked_s": min(r["blocked_s"] for r in mine),
            "total_s": fastest["total_s"],
            "bytes": fastest["bytes"],
            "mb_per_s": fastest["bytes"] / 1e6 / fastest["total_s"],
            "foreign_cores": fastest["foreign_cores"],
        }
    best["load"]["verified"] = all(r["verified"] for r in runs["load"])
    return best


def print_report(summary: dict[str, Any], console: Console) -> None:
    """The table (one row per mode) and the lines that qualify it."""
    s = Settings(**summary["settings"])
    title = (
        f"lmforge checkpoints: Llama d{s.hidden_size} x{s.num_hidden_layers}, ffn {s.intermediate_size}, "
        f"{s.num_attention_heads} heads, vocab {s.vocab_size:,} ({summary['parameters']:,} parameters) + AdamW, "
        f"fp32, 1 rank, {summary['threads']} threads, best of {summary['repeats']}"
    )
    table = common.result_table(title, ("mode", "blocked s", "total s", "bytes", "MB/s"))
    for mode in MODES:
        b = summary["best"][mode]
        table.add_row(mode, f"{b['blocked_s']:.3f}", f"{b['total_s']:.3f}", f"{b['bytes']:,}", f"{b['mb_per_s']:,.0f}")
    console.print(table)
    verified = summary["best"]["load"]["verified"]
    console.print(
        f"load verified: {'[green]yes[/]' if verified else '[red]no[/]'} (parameters and AdamW state equal the "
        "saved model's, exactly, in every repeat)"
    )
    w = summary["async_work"]
    console.print(
        f"async save while working: blocked {w['blocked_s']:.3f} s, then {w['matmuls']:,} matmuls "
        f"({WORK_SIZE}x{WORK_SIZE}) ran in {w['work_s']:.3f} s until the checkpoint was committed "
        f"({w['matmuls_per_s']:,.0f}/s against {w['idle_matmuls_per_s']:,.0f}/s with no save going on); "
        f"committed after {w['total_s']:.3f} s",
        highlight=False,
    )
    console.print(
        f"checkpoints written under {summary['dir']} (sync saves fsync their files); the load reads files just "
        "written, from the page cache."
    )
    contended = [m for m in MODES if summary["best"][m]["foreign_cores"] > FOREIGN_LIMIT]
    if contended and not summary["smoke"]:
        console.print(
            f"[yellow]other processes used the CPUs during the best {', '.join(contended)} run "
            f"(> {FOREIGN_LIMIT} cores): those figures are not reliable; rerun on an idle machine[/]"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    presets = {"default": FULL, "smoke": SMOKE}
    smoke = "tiny model and one repeat: checks the script runs"
    p = common.benchmark_parser(__doc__, presets, smoke, quiet_wait="before each measurement", all_cores=True)
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="make the temporary checkpoint folder under this folder (its file system is measured);\n"
        "default: the system's temporary folder. The folder made is removed at the end.",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the model, measure each mode, print the table, optionally write the JSON."""
    args = parse_args(argv)
    settings = common.with_flags(SMOKE if args.smoke else FULL, args)
    repeats = settings.repeats
    quiet_wait = common.quiet_wait_s(args)
    if repeats < 1 or settings.threads < 1:
        print("checkpoint.py: --repeats and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(settings.threads)
    console = common.make_console()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    ctx = init_distributed()
    try:
        model, optimizer = build(settings, ctx, init=True)
        optimizer_step(model, optimizer, settings.init_seed)
        parameters = sum(p.numel() for p in model.parameters())
        console.print(f"model: {parameters:,} parameters ({parameters * 4 / 2**20:,.1f} MiB fp32)", highlight=False)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        with tempfile.TemporaryDirectory(prefix="lmforge-ckpt-bench-", dir=args.dir) as tmp:
            base = Path(tmp)
            step = sync_step = 0  # every save gets a step of its own; load reads the latest sync one
            for r in range(repeats):
                for mode in MODES:
                    settle(quiet_wait)
                    if mode == "load":
                        path = base / "sync" / CHECKPOINTS / step_name(sync_step)
                        result = load_once(path, sync_step, settings, ctx, model, optimizer)
                        gc.collect()  # the freshly built model and optimizer
                    else:
                        step += 1
                        if mode == "sync":
                            sync_step = step
                        shutil.rmtree(base / mode, ignore_errors=True)  # the previous repeat's, outside the timing
                        result = save_once(base / mode, mode == "async", step, ctx, model, optimizer)
                    runs[mode].append(result)
                    extra = f", verified {'yes' if result['verified'] else 'no'}" if mode == "load" else ""
                    console.print(
                        f"run {r + 1}/{repeats} {mode:>5}: blocked {result['blocked_s']:.3f} s, total "
                        f"{result['total_s']:.3f} s, {result['bytes']:,} bytes, other processes "
                        f"{result['foreign_cores']:.2f} cores{extra}",
                        highlight=False,
                    )
            shutil.rmtree(base / "async", ignore_errors=True)
            settle(quiet_wait)
            async_work = save_while_working(base / "work", step + 1, ctx, model, optimizer)
        summary = {
            "settings": asdict(settings),
            "parameters": parameters,
            "threads": torch.get_num_threads(),
            "repeats": repeats,
            "smoke": args.smoke,
            "dir": str(args.dir if args.dir is not None else Path(tempfile.gettempdir())),
            "runs": runs,
            "best": summarize(runs),
            "async_work": async_work,
        }
    finally:
        shutdown_distributed()
    print_report(summary, console)
    common.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
