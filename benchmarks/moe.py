"""Mixture of experts against a dense model with the same active parameters: training tokens/s.

Two models with the same hidden size, layers and attention heads, trained on the same tokens:

- `moe`: a `glm4_moe` decoder with an MoE block in every layer (`first_k_dense_replace = 0`): 8 routed experts, top-2,
  1 shared expert, each expert a SwiGLU of width `moe_intermediate_size` = I. RoPE turns whole heads
  (`partial_rotary_factor = 1`), as in Llama, so attention is the same on both sides.
- `dense`: a `llama` decoder whose MLP width is (top_k + n_shared) x I = 3I. A token then multiplies the same number
  of expert/MLP weights on both sides (two routed experts and the shared one against one MLP three times as
  wide); the MoE adds its router (n_experts x hidden per layer). `count_params` gives both models' active matmul
  parameters, reported and checked: MoE minus its routers equals dense.

Each timed step is a training step: forward (`model(input_ids, position_ids, seq_lens, targets=...)`, which
returns the loss sum) and backward per packed row, then AdamW (foreach) and `zero_grad`. The rows are random
token ids in a few documents each (random cut points; positions restart at each document, no loss across a
boundary), drawn from one seed, so every side trains on the same tokens. Weights: `init_weights(std 0.02,
seed 0)`. On the CPU both models are fp32 on `--threads` threads; the MoE runs twice, once with every
`Experts.impl = "grouped_mm"` (`torch._grouped_mm`, what `auto` picks at these shapes) and once with `"loop"` (one
matmul pair per expert). With `--device cuda` the three sides run in bf16 (parameters and AdamW state) on a
bigger model: there the comparison of interest is the grouped kernel against the per-expert loop, which reads the
expert counts on the host in every layer.

Each side runs in its own spawned process, `--repeats` times, reversing the order of the sides at each repeat so
drift in the machine's speed favours none; a run is `--warmup` untimed steps, then `--steps` timed ones. A side's
tokens/s is its tokens per step over the median of all its timed steps. torch's thread pool is sized to the
machine, so any other busy process stalls it: before each run the script waits (`--quiet-wait` seconds at most)
for idle CPUs, and it reports the cores other processes used during each run's timed steps.

    .venv/bin/python benchmarks/moe.py [--device cpu|cuda] [--steps N] [--warmup N] [--repeats N] [--threads N]
                                       [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/moe.py --smoke      # tiny models, one short run per side (~10 s)

The script exits 0 when every side ran (it is a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from rich.console import Console

import common
from cpu_load import settle
from lmforge.config.arch import Glm4MoeArch, LlamaArch
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.model.loss import IGNORE_INDEX
from lmforge.model.moe import Experts
from lmforge.model.params import count_params

SIDES = ("dense", "moe_grouped_mm", "moe_loop")
"""The dense model, and the MoE with its routed experts as grouped matmuls and as a per-expert loop."""
IMPL = {"moe_grouped_mm": "grouped_mm", "moe_loop": "loop"}
"""`Experts.impl` of each MoE side."""
FOREIGN_LIMIT = 0.1
"""Cores of foreign load above which a side's figures are flagged as unreliable."""
SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The architecture fields both models take from the settings."""


@dataclass(frozen=True)
class Settings(common.TrainSettings):
    """Both models, the rows and the measurement protocol.

    A row is one packed forward of `seq_len` tokens (so `micro_batch_tokens` is `seq_len`), a step `batch_tokens`
    / `seq_len` rows; a row holds seq_len / `mean_doc_len` documents, cut at random points. `intermediate_size` is
    the dense model's MLP width: (top_k + n_shared_experts) x moe_intermediate_size, so that a token multiplies as
    many MLP weights in the dense model as expert weights in the MoE.
    """

    intermediate_size: int = 768
    seq_len: int = 1024
    batch_tokens: int = 2048
    micro_batch_tokens: int = 1024
    steps: int = 6
    moe_intermediate_size: int = 256
    """Width of one expert's SwiGLU (routed and shared)."""
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    repeats: int = 3
    threads: int = 2
    dtype: str = "float32"
    """Parameters, activations and AdamW state (fp32 on the CPU, bf16 on CUDA)."""

    def __post_init__(self) -> None:
        """Refuse settings whose sides would not be comparable, or whose rows are not whole forwards."""
        if self.intermediate_size != (self.top_k + self.n_shared_experts) * self.moe_intermediate_size:
            raise ValueError("intermediate_size must be (top_k + n_shared_experts) x moe_intermediate_size")
        if self.micro_batch_tokens != self.seq_len or self.batch_tokens % self.seq_len:
            raise ValueError("a row is one forward: micro_batch_tokens = seq_len, batch_tokens a multiple of it")

    @property
    def dense_intermediate_size(self) -> int:
        """The dense MLP width that matches the MoE's active expert weights per token."""
        return self.intermediate_size

    @property
    def rows(self) -> int:
        """Rows per optimizer step."""
        return self.batch_tokens // self.seq_len

    @property
    def segments(self) -> int:
        """Documents per row."""
        return round(self.seq_len / self.mean_doc_len)

    @property
    def tokens_per_step(self) -> int:
        """Row positions per optimizer step (the same on every side)."""
        return self.batch_tokens

    def arch(self, side: str) -> LlamaArch | Glm4MoeArch:
        """The architecture of a side: the Llama for `dense`, the GLM-4.5 MoE otherwise."""
        dense = self.llama_arch()
        if side == "dense":
            return dense
        # intermediate_size is the width of first_k_dense_replace's dense blocks: none here.
        return Glm4MoeArch(
            **dense.model_dump(include={*SHAPE, "max_position_embeddings"}),
            moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.top_k,
            n_shared_experts=self.n_shared_experts,
            first_k_dense_replace=0,
            partial_rotary_factor=1.0,
        )


SMOKE = common.tiny(Settings, intermediate_size=96, moe_intermediate_size=32)
"""Small enough that a test runs the whole script in seconds."""

CUDA = Settings(
    hidden_size=1024,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=16,
    moe_intermediate_size=512,
    vocab_size=32768,
    seq_len=4096,
    batch_tokens=4 * 4096,
    micro_batch_tokens=4096,
    mean_doc_len=512.0,
    warmup=3,
    steps=10,
    repeats=2,
    dtype="bfloat16",
)
"""The `--device cuda` default: a model big enough that kernels, not launches, set the step time."""


# ---------------------------------------------------------------------------------------------- one side


def make_rows(s: Settings) -> list[list[dict[str, torch.Tensor]]]:
    """Every step's packed rows (warmup included): random ids cut into `segments` documents at random points.

    Targets are the next token of the same document; a document's last position has none (IGNORE_INDEX).
    """
    gen = torch.Generator().manual_seed(s.data_seed)
    steps = []
    for _ in range(s.warmup + s.steps):
        rows = []
        for _ in range(s.rows):
            ids = torch.randint(0, s.vocab_size, (s.seq_len,), generator=gen)
            cuts = torch.randperm(s.seq_len - 1, generator=gen)[: s.segments - 1].add(1).sort().values
            bounds = [0, *cuts.tolist(), s.seq_len]
            lens = torch.tensor([b - a for a, b in itertools.pairwise(bounds)])
            positions = torch.cat([torch.arange(int(n)) for n in lens])
            targets = torch.cat([ids[1:], ids[:1]])
            targets[lens.cumsum(0) - 1] = IGNORE_INDEX
            rows.append(
                {"input_ids": ids[None], "position_ids": positions[None], "seq_lens": lens, "targets": targets[None]}
            )
        steps.append(rows)
    return steps


def build(side: str, s: Settings, device: torch.device) -> CausalLM:
    """The side's model, initialized, on the device in the benchmark's dtype, with its experts' impl set."""
    model = build_model(s.arch(side), s.vocab_size, "sdpa", device)
    init_weights(model, s.init_std, s.init_seed)
    model.to(device)
    dtype = getattr(torch, s.dtype)
    with torch.no_grad():
        # Parameters only: the MoE statistics buffers stay fp32 (bf16 cannot count past 256 exactly).
        for p in model.parameters():
            p.data = p.data.to(dtype)
    for module in model.modules():
        if isinstance(module, Experts):
            module.impl = IMPL[side]
    return model.train()


def run_training(side: str, s: Settings, device: torch.device) -> dict[str, Any]:
    """Build the side's model, train warmup + timed steps, and return the timings, losses and parameter counts."""
    model = build(side, s, device)
    counts = count_params(model)
    router = sum(moe.gate.weight.numel() for moe in model.moe_layers().values())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        foreach=True,
    )
    steps = make_rows(s)
    # Counted on the host before the clock starts: reading them from the device would synchronize.
    loss_tokens = [sum(int((row["targets"] != IGNORE_INDEX).sum()) for row in rows) for rows in steps]
    steps = [[{k: v if k == "seq_lens" else v.to(device) for k, v in row.items()} for row in rows] for rows in steps]

    def step(i: int) -> tuple[torch.Tensor, float]:
        """Training step `i`; returns the mean loss (on the device) and when the optimizer step began."""
        total = torch.zeros((), device=device)
        for row in steps[i]:
            loss = model(row["input_ids"], row["position_ids"], row["seq_lens"], targets=row["targets"])
            (loss / loss_tokens[i]).backward()
            total += loss.detach() / loss_tokens[i]
        # The MoE holds (experts + shared) / (top_k + shared) times the dense MLP's weights: its AdamW step is
        # where total (not active) parameters cost time, so it is timed on its own too.
        common.sync(device)
        t_opt = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total, t_opt

    timing = common.timed_steps(s.warmup, s.steps, step, device)
    opt_starts = [t_opt for _, t_opt in timing.results[s.warmup :]]
    load = [moe.tokens_per_expert.float() for moe in model.moe_layers().values()]
    return {
        "seconds": timing.seconds,
        "optimizer_s": [end - t_opt for end, t_opt in zip(timing.ends, opt_starts, strict=True)],
        "losses": [float(loss) for loss, _ in timing.results],  # after the clock: a host read is not part of a step
        "foreign_cores": timing.foreign_cores,
        "params": {**asdict(counts), "router": router},
        # Busiest expert over the mean, worst layer, over all steps: the loop's matmuls are as uneven as this.
        "expert_load_max_over_mean": max(float(c.max() / c.mean()) for c in load) if load else None,
    }


def measure_side(side: str, s: Settings, device_name: str) -> dict[str, Any]:
    """Run one side in this (spawned) process and return its figures."""
    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(s.threads)
    t0 = time.perf_counter()
    result = run_training(side, s, device)
    return {"side": side, **result, "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t0}


def run_side(side: str, s: Settings, device: str) -> dict[str, Any]:
    """Run one side in a fresh spawned process and return its figures."""
    result = common.run_in_child(measure_side, (side, s, device), f"moe-bench-{side}")
    return common.raise_for_error(result, f"the {side} side")


# ---------------------------------------------------------------------------------------------- report


def summarize(runs: list[dict[str, Any]], s: Settings, device: str) -> dict[str, Any]:
    """Per side: the median timed step over all its runs and the tokens/s it gives; the ratios and the checks."""
    sides: dict[str, Any] = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        median = statistics.median(t for r in mine for t in r["seconds"])
        sides[side] = {
            "impl": IMPL.get(side),
            "median_step_s": median,
            "median_optimizer_s": statistics.median(t for r in mine for t in r["optimizer_s"]),
            "tokens_per_s": s.tokens_per_step / median,
            "run_tokens_per_s": [s.tokens_per_step / statistics.median(r["seconds"]) for r in mine],
            "foreign_cores": max(r["foreign_cores"] for r in mine),
            "first_loss": mine[0]["losses"][0],
            "expert_load_max_over_mean": mine[0]["expert_load_max_over_mean"],
        }
    dense, moe = runs_params(runs, "dense"), runs_params(runs, "moe_grouped_mm")
    # The same weights and tokens through two expert implementations: the first step's loss (before any update)
    # must agree to float rounding.
    first_loss_diff = abs(sides["moe_grouped_mm"]["first_loss"] - sides["moe_loop"]["first_loss"])
    return {
        "settings": asdict(s),
        "device": device,
        "dense_intermediate_size": s.dense_intermediate_size,
        "tokens_per_step": s.tokens_per_step,
        "runs": runs,
        "sides": sides,
        "params": {"dense": dense, "moe": moe},
        "active_matmul_without_router": {"dense": dense["active_matmul"], "moe": moe["active_matmul"] - moe["router"]},
        "active_matmul_equal": moe["active_matmul"] - moe["router"] == dense["active_matmul"],
        "moe_over_dense": sides["moe_grouped_mm"]["tokens_per_s"] / sides["dense"]["tokens_per_s"],
        "loop_over_dense": sides["moe_loop"]["tokens_per_s"] / sides["dense"]["tokens_per_s"],
        "grouped_over_loop": sides["moe_grouped_mm"]["tokens_per_s"] / sides["moe_loop"]["tokens_per_s"],
        "first_loss_diff_grouped_loop": first_loss_diff,
    }


def runs_params(runs: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """The parameter counts one run of `side` reported (every run builds the same model)."""
    return next(r["params"] for r in runs if r["side"] == side)


def print_report(summary: dict[str, Any], console: Console) -> None:
    """The table of the three sides, then the parameter counts, the ratios and the checks."""
    s = Settings(**summary["settings"])
    title = (
        f"MoE ({s.n_routed_experts} experts, top-{s.top_k}, {s.n_shared_experts} shared, width "
        f"{s.moe_intermediate_size}) vs dense (MLP {s.dense_intermediate_size}): d{s.hidden_size} "
        f"x{s.num_hidden_layers}, {s.num_attention_heads} heads, {s.rows} rows of {s.seq_len} per step, "
        f"{s.dtype}, {summary['device']}, {summary['runs'][0]['threads']} threads, median of {s.repeats} x "
        f"{s.steps} steps after {s.warmup}"
    )
    columns = ("side", "params", "active matmul", "median step s", "of it AdamW s", "tokens/s", "vs dense",
               "foreign cores")  # fmt: skip
    table = common.result_table(title, columns)
    params = summary["params"]
    for side in SIDES:
        f = summary["sides"][side]
        p = params["dense" if side == "dense" else "moe"]
        ratio = f["tokens_per_s"] / summary["sides"]["dense"]["tokens_per_s"]
        cells = [f"{p['total']:,}", f"{p['active_matmul']:,.0f}", f"{f['median_step_s']:.4f}",
                 f"{f['median_optimizer_s']:.4f}", f"{f['tokens_per_s']:,.0f}", f"{ratio:.3f}x"]  # fmt: skip
        table.add_row(side, *cells, f"{f['foreign_cores']:.2f}")
    console.print(table)
    same = summary["active_matmul_equal"]
    without = summary["active_matmul_without_router"]
    console.print(
        f"active matmul parameters (count_params): dense {params['dense']['active_matmul']:,.0f}, MoE "
        f"{params['moe']['active_matmul']:,.0f} = {without['moe']:,.0f} + {params['moe']['router']:,} router "
        f"weights; without the routers {'[green]equal[/]' if same else '[red]NOT equal[/]'} to dense. "
        f"Active non-embedding: dense {params['dense']['active_non_embedding']:,.0f}, MoE "
        f"{params['moe']['active_non_embedding']:,.0f}."
    )
    console.print(
        f"MoE (grouped_mm) / dense tokens/s: {summary['moe_over_dense']:.3f}x; MoE loop / dense: "
        f"{summary['loop_over_dense']:.3f}x; grouped_mm / loop: {summary['grouped_over_loop']:.3f}x",
        highlight=False,
    )
    load = summary["sides"]["moe_grouped_mm"]["expert_load_max_over_mean"]
    console.print(
        f"checks: first-step loss grouped_mm {summary['sides']['moe_grouped_mm']['first_loss']:.6f}, loop "
        f"{summary['sides']['moe_loop']['first_loss']:.6f} (diff {summary['first_loss_diff_grouped_loop']:.1e}); "
        f"busiest expert / mean (worst layer, all steps) {load:.2f}",
        highlight=False,
    )
    contended = [side for side in SIDES if summary["sides"][side]["foreign_cores"] > FOREIGN_LIMIT]
    if contended:
        console.print(
            f"[yellow]other processes used the CPUs during {', '.join(contended)} (> {FOREIGN_LIMIT} cores in a "
            "run): the figures are not reliable; rerun on an idle machine[/]"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen device and size."""
    presets = {"default": Settings(), "cuda": CUDA, "smoke": SMOKE}
    p = common.benchmark_parser(__doc__, presets, "tiny models, one short run per side", quiet_wait="before each run")
    p.add_argument("--device", default="cpu", help="cpu (default: fp32) or cuda (bf16, a bigger model)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every side, print the table, optionally write the JSON; 0 unless a side failed to run."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("moe.py: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if device.type == "cuda" and not hasattr(torch, "_grouped_mm"):
        print("moe.py: this torch has no torch._grouped_mm", file=sys.stderr)
        return 2
    base = SMOKE if args.smoke else CUDA if device.type == "cuda" else Settings()
    if args.smoke and device.type == "cuda":
        base = replace(base, dtype="bfloat16")
    s = common.with_flags(base, args)
    if s.steps < 1 or s.warmup < 0 or s.repeats < 1 or s.threads < 1:
        print("moe.py: --steps, --repeats and --threads must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    quiet_wait = common.quiet_wait_s(args)
    console = common.make_console(140)
    runs: list[dict[str, Any]] = []
    for r in range(s.repeats):
        for side in common.in_turn(SIDES, r):
            quiet = settle(quiet_wait)
            result = run_side(side, s, str(device))
            result["busy_cores_before"] = quiet
            console.print(
                f"run {r + 1}/{s.repeats} {side:>14}: "
                f"{s.tokens_per_step / statistics.median(result['seconds']):,.0f} tokens/s (median step), "
                f"other processes {result['foreign_cores']:.2f} cores ({result['wall_s']:.1f} s)",
                highlight=False,
            )
            runs.append(result)
    summary = summarize(runs, s, str(device))
    print_report(summary, console)
    common.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
