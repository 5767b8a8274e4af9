"""Single-GPU training throughput and MFU of lmforge: dense Llamas of ~125M, ~350M and ~1B parameters in bf16, the
1B again with FP8 linear layers (both recipes), and a fine-grained MoE.

Each row trains in-process through lmforge's own step (`Trainer.train_step`, the step `lmforge train` runs: FSDP2
over one rank with bf16 parameters and fp32 master weights, the step statistics, the background data prefetcher),
on fake data shaped like pretraining data: seq_len 4096, a 32768-token vocabulary, documents of geometric length
(mean 1024 tokens) with document masking on. Defaults: bf16, AdamW (`--optim muon` for Muon), `torch.compile` of
each block (`--no-compile`), the LM head and loss computed 4096 tokens at a time, `model.attn = "auto"` (flash,
varlen or flex attention, whichever the machine has).

| size | shape                                       | params       | seq  | micro-batch | batch tokens | ac        |
|------|---------------------------------------------|--------------|------|-------------|--------------|-----------|
| 125m | d768, 12 layers, 12 heads (MHA), ffn 2048   | 135M         | 4096 | 64K (16 w)  | 256K (4 mb)  | none      |
| 350m | d1024, 24 layers, 16 heads (MHA), ffn 2816  | 375M         | 4096 | 32K (8 w)   | 256K (8 mb)  | none      |
| 1b   | d2048, 16 layers, 32 heads, 8 KV, ffn 8192  | 1.11B        | 4096 | 32K (8 w)   | 128K (4 mb)  | selective |
| moe  | d1024, 16 layers, 16 heads (MHA), see below | 1.68B (0.32B | 4096 | 32K (8 w)   | 256K (8 mb)  | none      |
|      |                                             | active)      |      |             |              |           |

The moe size: layer 0 dense (ffn 2816), layers 1-15 with 64 routed experts (top-8) and 1 shared expert, each a
SwiGLU of width 512.

A row is a size, or `SIZE+RECIPE` for the same size with `model.fp8 = RECIPE` (`tensorwise` or `rowwise`: the
blocks' linear layers in FP8 through torchao, docs/model.md). The default rows are `125m 350m 1b 1b+tensorwise
1b+rowwise moe`. (Untied embeddings; the 1b shape is Llama-3.2-1B's with a 32K vocabulary; the moe row is a
`glm4_moe` decoder whose routed experts run as grouped matmuls. The micro-batches use well under half of an H200's
141 GB, so a size still fits with `--ac none` or `--optim muon`; `selective` keeps the outputs of the matmuls and
attention and recomputes the rest, which is what a 1B run at larger micro-batches needs. The recomputation is not
counted in the FLOPs, so MFU is what the run achieves, not what the GPU executes. MFU is over the bf16 peak for
the FP8 rows too, so their gain shows as a higher MFU.)

Each row runs in its own spawned process (a clean allocator, its own peak memory, and an OOM or a crash cannot take
the others down): build the trainer, `--warmup` untimed steps (compilation and recompilations happen there), then
`--steps` timed steps, the CUDA stream synchronized before each clock read. A timed step is
`trainer.data.next_step()` + `trainer.train_step(...)`, exactly what `Trainer.train` does per step minus the
metrics file and console. Per row: parameters, tokens/s (timed tokens / timed seconds), MFU (the FLOPs of
`lmforge.train.flops`: 6 x active matmul params x tokens plus the attention of the pairs actually attended, over
the device's dense bf16 peak), MFU 6ND (the matmul term alone), peak allocated CUDA memory, the attention backend,
the median step time, and the setup time (trainer build + compile + warmup, after the imports). A row that fails
(out of memory, a crash, past `--timeout`) gets its error in its row and the next row runs.

Time on one H200 (estimated, not yet measured): the first step of a row compiles its block forward and backward
(~30-60 s), plus ~10-20 s of process start, CUDA and model setup; at 30-45% MFU the steps take ~0.5 s (125m),
~1.5 s (350m) and ~2 s (1b), so 20 steps add ~10 s, ~30 s and ~40 s per row. Each row is stopped after `--timeout`
seconds (default 300). `benchmarks/gpu_check.sh` runs the default rows with fewer steps.

    .venv/bin/python benchmarks/gpu.py [--rows 125m 350m 1b 1b+tensorwise 1b+rowwise moe] [--steps N] [--warmup N]
                                       [--optim adamw|muon] [--no-compile] [--ac none|full|selective]
                                       [--attn auto|flash|varlen|flex|sdpa] [--loss-chunk-tokens N] [--timeout S]
                                       [--json PATH] [--markdown PATH]
    .venv/bin/python benchmarks/gpu.py --smoke      # tiny fp32 rows on the CPU (FP8 emulated), 1 + 2 steps

The script exits 0 when it ran, even if a row failed (its row says why); 2 on bad flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

import common
from lmforge.checkpoint.run_dir import prepare_output_dir
from lmforge.config import TrainConfig
from lmforge.config.arch import Glm4MoeArch
from lmforge.config.checks import check_config
from lmforge.parallel.process_group import init_distributed, shutdown_distributed
from lmforge.train.trainer import Trainer

K = 1024


@dataclass(frozen=True)
class Size(common.TrainSettings):
    """One model size, its batch geometry, and the steps and lr it runs (`--steps`, `--warmup` set every size's)."""

    name: str = "custom"
    vocab_size: int = 32768
    seq_len: int = 4096
    batch_tokens: int = 256 * K
    micro_batch_tokens: int = 32 * K
    mean_doc_len: float = 1024.0
    lr: float = 3e-4
    warmup: int = 5
    steps: int = 15
    ac: str = "none"
    """Default activation checkpointing of this size (`--ac` overrides it for every size)."""
    fp8: str = "none"
    """`model.fp8` of the row (`SIZE+RECIPE` in `--rows`)."""
    experts: int = 0
    """Routed experts per MoE layer; 0: a dense Llama."""
    top_k: int = 0
    expert_size: int = 0
    """Each routed and shared expert's SwiGLU width."""

    def model_section(self, init: Any = None, **options: Any) -> dict[str, Any]:
        """The `[model]` table: a Llama, or for an MoE size a `glm4_moe` decoder (first layer dense, one shared
        expert, RoPE on whole heads), with the row's FP8 recipe."""
        section = super().model_section(init, **options)
        if self.experts:
            # the dense fields GLM shares (its own rope base and eps; no hidden_act: its experts' activation is fixed)
            dense = {k: v for k, v in section["arch"].items() if k not in ("model_type", "rope_theta", "rms_norm_eps",
                                                                           "hidden_act")}  # fmt: skip
            section["arch"] = Glm4MoeArch(
                **dense,
                moe_intermediate_size=self.expert_size,
                n_routed_experts=self.experts,
                num_experts_per_tok=self.top_k,
                n_shared_experts=1,
                first_k_dense_replace=1,
                partial_rotary_factor=1.0,
            ).model_dump()
        if self.fp8 != "none":
            section["fp8"] = self.fp8
        return section


def _size(name: str, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, **other: Any) -> Size:
    """A size of the table, its shape in the order the table of the docstring gives it."""
    return Size(
        name=name,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **other,
    )


SIZES: dict[str, Size] = {
    "125m": _size("125m", 768, 2048, 12, 12, 12, micro_batch_tokens=64 * K),
    "350m": _size("350m", 1024, 2816, 24, 16, 16),
    "1b": _size("1b", 2048, 8192, 16, 32, 8, batch_tokens=128 * K, ac="selective"),
    "moe": _size("moe", 1024, 2816, 16, 16, 16, experts=64, top_k=8, expert_size=512),
}
"""The sizes, smallest dense first (a failure of a big size still leaves the small ones measured)."""

FP8_RECIPES = ("tensorwise", "rowwise")
"""What may follow a size in `--rows` (`1b+tensorwise`)."""

DEFAULT_ROWS = ("125m", "350m", "1b", "1b+tensorwise", "1b+rowwise", "moe")
"""The default table: the dense sizes in bf16, the 1B in both FP8 recipes, and the MoE."""

SMOKE = common.tiny(Size, name="smoke", num_key_value_heads=4, vocab_size=512)
"""A model and batch small enough that a test runs the script in seconds on the CPU."""

SMOKE_ROWS = {
    "smoke": SMOKE,
    "smoke+tensorwise": replace(SMOKE, name="smoke+tensorwise", fp8="tensorwise"),
    "smoke-moe": replace(SMOKE, name="smoke-moe", experts=8, top_k=2, expert_size=32),
}
"""The smoke table: the tiny model, its FP8 row (emulated on the CPU) and a tiny MoE."""


def row_size(spec: str) -> Size:
    """The size of one `--rows` entry: `SIZE` or `SIZE+RECIPE`."""
    name, _, recipe = spec.partition("+")
    if name not in SIZES or (recipe and recipe not in FP8_RECIPES):
        raise ValueError(f"unknown row {spec!r}: a size of {list(SIZES)}, optionally +{'|+'.join(FP8_RECIPES)}")
    return replace(SIZES[name], name=spec, fp8=recipe) if recipe else SIZES[name]


@dataclass(frozen=True)
class Options:
    """What every size shares: optimizer, compilation, attention and loss chunking."""

    optim: str = "adamw"
    compile: bool = True
    ac: str | None = None
    """None: each size's own default."""
    attn: str = "auto"
    loss_chunk_tokens: int = 4096
    param_dtype: str = "auto"
    """`auto`: bf16 on CUDA, fp32 on the CPU."""
    fp8_emulate: bool = False
    """FP8 rows emulate the float8 matmuls (the smoke run on the CPU)."""


def train_config(size: Size, opts: Options, output_dir: str) -> TrainConfig:
    """The lmforge config of one size: constant lr, no checkpoint, fake pretraining-like data."""
    model = {
        "attn": opts.attn,
        "param_dtype": opts.param_dtype,
        "compile": opts.compile,
        "ac": {"mode": opts.ac or size.ac},
        "loss_chunk_tokens": opts.loss_chunk_tokens,
        "fp8_emulate": opts.fp8_emulate and size.fp8 != "none",
    }
    return size.train_config(output_dir, model=model, optim={"type": opts.optim}, ckpt={"final": False})


# ---------------------------------------------------------------------------------------------- one size


def measure(size: Size, opts: Options) -> dict[str, Any]:
    """Build the trainer of `size`, run the warmup and timed steps, return the figures of its row."""
    t_start = time.perf_counter()
    ctx = init_distributed()
    device = ctx.device
    try:
        with tempfile.TemporaryDirectory(prefix=f"lmforge-gpu-{size.name}-") as tmp:
            config = train_config(size, opts, str(Path(tmp) / "run"))
            check_config(config, ctx.world_size)
            prepare_output_dir(config, overwrite=False)
            trainer = Trainer(config, ctx, console=False)
            try:
                backend = getattr(trainer.model, "attn_backend", None)

                def step(_: int) -> dict[str, float]:
                    # What Trainer.train does per step, minus the metrics file and console.
                    t0 = time.perf_counter()
                    micro_batches = trainer.data.next_step()
                    return trainer.train_step(micro_batches, time.perf_counter() - t0)

                timing = common.timed_steps(size.warmup, size.steps, step, device)
                timed = timing.results[size.warmup :]
                seconds = timing.seconds
                tokens = sum(m["batch/tokens"] for m in timed)
                pairs = sum(m["batch/pairs"] for m in timed)
                total_s = sum(seconds)
                flops, dense = trainer.flops.step_flops(tokens, pairs)
                peak = trainer.peak_flops
                cuda = device.type == "cuda"
                row: dict[str, Any] = {
                    "params": trainer.params["params/total"],
                    "tokens_per_s": tokens / total_s,
                    "mfu_pct": 100 * flops / (total_s * peak) if peak else None,
                    "mfu_6nd_pct": 100 * dense / (total_s * peak) if peak else None,
                    "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
                    "attn_backend": backend,
                    "median_step_s": statistics.median(seconds),
                    "step_s": seconds,
                    "setup_s": timing.timed_from - t_start,
                    "timed_tokens": tokens,
                    "timed_pairs": pairs,
                    "flops_per_token": flops / tokens,
                    "peak_flops": peak,
                    "losses": [m["loss/mean"] for m in timing.results],
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "torch": torch.__version__,
                }
                return row
            finally:
                trainer.close()
    finally:
        shutdown_distributed()


def measure_in_child(size: Size, opts: Options) -> dict[str, Any]:
    """`measure` in a spawned child, with the CUDA allocator set up for large micro-batches."""
    # Fewer fragmentation OOMs at large micro-batches; read when CUDA first allocates, so it must be set first.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return measure(size, opts)


def run_size(size: Size, opts: Options, timeout: float) -> dict[str, Any]:
    """Measure one size in a fresh spawned process; a failure or a timeout becomes the row's `error`."""
    row: dict[str, Any] = {
        "size": size.name,
        **{k: v for k, v in asdict(size).items() if k != "name"},
        "ac": opts.ac or size.ac,
        "compile": opts.compile,
        "optim": opts.optim,
    }
    t0 = time.perf_counter()
    row.update(common.run_in_child(measure_in_child, (size, opts), f"gpu-bench-{size.name}", timeout=timeout))
    row["wall_s"] = time.perf_counter() - t0
    row.update(plan_figures(size, opts, row))
    return row


def plan_figures(size: Size, opts: Options, row: dict[str, Any]) -> dict[str, Any]:
    """`lmforge plan`'s figures for the same step (on this machine's CPU, fake tensors, the GPU named in the row's
    device, else H100) and their ratios to the measured ones: peak memory against `torch.cuda.max_memory_allocated`,
    the estimated step time against the measured median. A plan that fails is the row's `plan_error`."""
    from lmforge.plan.gpus import gpu_spec
    from lmforge.plan.step import plan_step

    device = str(row.get("device", "")).lower()
    name = next((n for n in ("h200", "h100", "b200", "a100") if n in device), "h100")
    try:
        with tempfile.TemporaryDirectory(prefix=f"lmforge-plan-{size.name}-") as tmp:
            plan = plan_step(train_config(size, opts, str(Path(tmp) / "run")), 1, gpu_spec(name), 8)
    except Exception as e:  # reported in the row: the measured figures stand
        return {"plan_error": f"{type(e).__name__}: {e}"}
    figures: dict[str, Any] = {"plan_gpu": name, "plan_peak_gib": plan.peak_bytes / 2**30,
                               "plan_step_s": plan.step_seconds}  # fmt: skip
    if row.get("peak_memory_gib"):
        figures["plan_memory_ratio"] = figures["plan_peak_gib"] / row["peak_memory_gib"]
    if row.get("median_step_s") and device not in ("", "cpu"):
        figures["plan_time_ratio"] = plan.step_seconds / row["median_step_s"]
    return figures


# ---------------------------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], opts: Options, console: Console) -> None:
    """One row per size; a failed size shows its error instead of figures."""
    device = next((r["device"] for r in rows if "device" in r), "the device (no size ran)")
    title = (
        f"lmforge training throughput on {device}: {opts.optim}, compile {'on' if opts.compile else 'off'}, "
        f"loss chunk {opts.loss_chunk_tokens}, {rows[0]['steps']} timed steps after {rows[0]['warmup']}"
    )
    columns = ("size", "params", "seq / micro / batch", "ac", "tokens/s", "MFU %", "MFU 6ND %", "peak mem GiB",
               "attention", "median step s", "setup s", "plan GiB (/ peak)", "plan step s (/ median)")  # fmt: skip
    table = common.result_table(title, columns, left={"size", "ac", "attention"})
    for r in rows:
        geometry = f"{r['seq_len']} / {r['micro_batch_tokens'] // K}K / {r['batch_tokens'] // K}K"
        if r["seq_len"] < K:
            geometry = f"{r['seq_len']} / {r['micro_batch_tokens']} / {r['batch_tokens']}"
        params = f"{r['params'] / 1e6:,.1f}M" if "params" in r else "-"
        head = [r["size"], params, geometry, r["ac"]]
        if "error" in r:
            table.add_row(*head, f"[red]{escape(r['error'])}[/]", *[""] * 8)
            continue
        table.add_row(
            *head,
            f"{r['tokens_per_s']:,.0f}",
            _fmt(r["mfu_pct"], ".1f"),
            _fmt(r["mfu_6nd_pct"], ".1f"),
            _fmt(r["peak_memory_gib"], ".1f"),
            str(r["attn_backend"]),
            f"{r['median_step_s']:.3f}",
            f"{r['setup_s']:.0f}",
            *_plan_cells(r),
        )
    console.print(table)
    console.print(
        "MFU: (6 x matmul params x tokens + 12 x layers x heads x head_dim x attended pairs) / (time x bf16 peak); "
        "MFU 6ND: the matmul term alone. Recomputation under activation checkpointing is not counted. "
        "setup s: trainer build to the first timed step (build, compile, warmup; the imports not included)."
    )


def _plan_cells(r: dict[str, Any]) -> list[str]:
    """The plan's peak memory and step time, each with its ratio to the measured figure where there is one."""
    if "plan_error" in r:
        return [f"failed: {r['plan_error'][:60]}", ""]
    if "plan_peak_gib" not in r:
        return ["-", "-"]
    memory = f"{r['plan_peak_gib']:.1f}" + (f" ({r['plan_memory_ratio']:.2f}x)" if "plan_memory_ratio" in r else "")
    time_s = f"{r['plan_step_s']:.3f}" + (f" ({r['plan_time_ratio']:.2f}x)" if "plan_time_ratio" in r else "")
    return [memory, time_s]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (for docs/benchmarks.md), a failed row with its error."""
    lines = [
        "| row | params | tokens/s | MFU % | MFU 6ND % | peak GiB | attention | median step s | setup s "
        "| plan GiB (/ peak) | plan step s (/ median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        params = f"{r['params'] / 1e6:,.1f}M" if "params" in r else "-"
        if "error" in r:
            lines.append(f"| {r['size']} | {params} | failed: {r['error'].splitlines()[0][:150]} | | | | | | | | |")
            continue
        figures = [f"{r['tokens_per_s']:,.0f}", _fmt(r["mfu_pct"], ".1f"), _fmt(r["mfu_6nd_pct"], ".1f"),
                   _fmt(r["peak_memory_gib"], ".1f"), str(r["attn_backend"]), f"{r['median_step_s']:.3f}",
                   f"{r['setup_s']:.0f}", *_plan_cells(r)]  # fmt: skip
        lines.append(f"| {r['size']} | {params} | " + " | ".join(figures) + " |")
    device = next((r["device"] for r in rows if "device" in r), "no device")
    torch_version = next((r["torch"] for r in rows if "torch" in r), "?")
    return f"On {device}, torch {torch_version}:\n\n" + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    smoke = "tiny fp32 model on the CPU, 1 + 2 steps: checks the script"
    p = common.benchmark_parser(__doc__, {"default": SIZES["125m"], "smoke": SMOKE}, smoke)
    p.add_argument(
        "--rows",
        nargs="+",
        default=list(DEFAULT_ROWS),
        help=f"rows to run: a size of {list(SIZES)}, optionally +tensorwise or +rowwise for FP8 "
        f"(default: {' '.join(DEFAULT_ROWS)})",
    )
    p.add_argument("--optim", choices=("adamw", "muon"), default="adamw", help="optimizer (default adamw)")
    p.add_argument("--no-compile", action="store_true", help="don't torch.compile the blocks")
    p.add_argument(
        "--ac",
        choices=("none", "full", "selective"),
        default=None,
        help="activation checkpointing of every size (default: none for 125m/350m, selective for 1b)",
    )
    p.add_argument("--attn", default="auto", help="attention backend (default auto: flash/varlen/flex on CUDA)")
    p.add_argument("--loss-chunk-tokens", type=int, default=4096, help="LM head + loss chunk (default 4096; 0: all)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one row may take before it is stopped")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run each size, print the table, optionally write the JSON; 0 when it ran."""
    args = parse_args(argv)
    opts = Options(
        optim=args.optim,
        compile=not args.no_compile,
        ac=args.ac,
        attn=args.attn,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )
    try:
        sizes = [row_size(spec) for spec in args.rows]
    except ValueError as err:
        print(f"gpu.py: --rows: {err}", file=sys.stderr)
        return 2
    if args.smoke:
        opts = replace(opts, compile=False, param_dtype="float32", fp8_emulate=True)
        sizes = list(SMOKE_ROWS.values())
    sizes = [common.with_flags(size, args) for size in sizes]
    if sizes[0].steps < 1 or sizes[0].warmup < 0 or opts.loss_chunk_tokens < 0:
        print("gpu.py: --steps must be >= 1, --warmup and --loss-chunk-tokens >= 0", file=sys.stderr)
        return 2
    console = common.make_console(160)
    rows: list[dict[str, Any]] = []
    for size in sizes:
        row = run_size(size, opts, args.timeout)
        if "error" in row:
            console.print(
                f"{size.name}: [red]failed[/] after {row['wall_s']:.0f} s: {escape(row['error'])}", highlight=False
            )
        else:
            console.print(
                f"{size.name}: {row['tokens_per_s']:,.0f} tokens/s, MFU % {_fmt(row['mfu_pct'], '.1f')}, "
                f"peak GiB {_fmt(row['peak_memory_gib'], '.1f')}, {row['attn_backend']} ({row['wall_s']:.0f} s)",
                highlight=False,
            )
        rows.append(row)
    print_table(rows, opts, console)
    common.write_json(args.json, {"settings": asdict(opts), "rows": rows})
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
