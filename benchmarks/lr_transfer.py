"""Learning-rate transfer across width under CompleteP, and Muon against AdamW, on the demo data, on the CPU.

Every run trains a Llama from scratch on the demo's Shakespeare token shards (`data/demo/train`, built by
`lmforge demo --prepare-only` if `--data-dir` lacks them) with lmforge's own `Trainer` in a process group of one,
stepped as `Trainer.train` steps it (`trainer.data.next_step()` then `trainer.train_step(...)`), no checkpoint.
All runs share the init seed, the data order, the batch (seq_len 256 windows, document masking on) and the
warmup-stable-decay schedule (linear warmup over 10% of the steps, linear decay to 0 over the last 20%); they
differ only in width, init scheme, optimizer and learning rate. Models are 4 layers deep with heads of 32 dims and
an intermediate size of 8/3 x width rounded to a multiple of 32. The figure of merit is the held-out loss: the mean
cross-entropy (fp32, over every target token) of a fixed set of windows of `data/demo/heldout` (16,384 tokens by
default, the same windows for every run), taken once the run is over.

1. LR transfer (AdamW). Widths 64, 128 and 256, each under `model.init.scheme = "normal"` (the standard
   parameterization: one lr for every parameter) and `"completep"` with base shape width 64 x 4 layers (per-role
   init, lr, weight decay and eps factors, see docs/model.md). At the base shape CompleteP is the standard
   parameterization (every factor is 1), so the width-64 runs are trained once and reported under both schemes.
   The learning rate runs over a grid of powers of 2 (a grid step is 2x). Where the best lr of a (scheme, width)
   lies at the edge of the lrs tried, the grid is extended on that side, one step at a time (`--max-extend` steps
   at most), so the best lr is bracketed by two worse ones. The spread of the best lr across widths is counted in
   grid steps. Target: under CompleteP the best lr moves by at most one grid step across the 4x width range.
2. Muon vs AdamW at width 128 under the standard parameterization. AdamW's runs are the LR-transfer runs of that
   width (its grid); Muon (`adjust_lr = "match_adamw_rms"`, one lr for its matrices and its AdamW groups) runs a
   grid of 4 lrs, extended at an edge as above. These runs also measure the held-out loss every `--eval-every`
   steps. Each optimizer at its best lr (lowest final held-out loss) is read for the tokens it needed to first
   reach a target held-out loss: AdamW's final held-out loss plus `--target-margin` (0.02 nats), a loss both
   optimizers reach when Muon is at least as good, with linear interpolation between two evaluations. Target: Muon
   needs <= 0.8x AdamW's tokens. Each optimizer is read off its one run of fixed length: the target is met near
   the end of AdamW's run, in its decay, so Muon meets the target ahead of AdamW only if it gets there while its
   own lr has not (fully) decayed: a conservative measure of Muon's advantage.

A run whose training loss is not finite, or exceeds its first step's loss by more than 1 nat, is stopped there and
marked diverged (its held-out loss is taken at that point). Runs are in-process, one at a time, in fp32 with
`--threads` threads; other processes on the CPUs slow the benchmark down but do not change its figures, which are
losses and learning rates (the same settings give the same figures).

    .venv/bin/python benchmarks/lr_transfer.py [--steps N] [--batch-tokens N] [--lrs LO HI] [--muon-lrs LO HI]
                                               [--max-extend N] [--eval-every N] [--target-margin X]
                                               [--data-dir DIR] [--threads N] [--json PATH]
    .venv/bin/python benchmarks/lr_transfer.py --smoke     # widths 32 and 64, 2 lrs, 4 steps (~20 s)

lrs are given as base-2 exponents (`--lrs -9 -6` is 2^-9 .. 2^-6). The full benchmark takes about 20 minutes on
2 idle cores. The script always exits 0 when it ran (it is a benchmark, not a test); PASS/MISS marks each target.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from lmforge.config import TokensDataConfig, TrainConfig
from lmforge.config.checks import check_config
from lmforge.data import load_tokenizer
from lmforge.data.batch import MicroBatch
from lmforge.data.tokens import TokenData
from lmforge.demo import prepare_demo_data
from lmforge.train.micro_batches import token_loss_sum
from lmforge.train.parallel import DistContext, init_distributed, shutdown_distributed
from lmforge.train.setup import prepare_output_dir
from lmforge.train.trainer import Trainer

SCHEMES = ("normal", "completep")
OPTIMIZERS = ("adamw", "muon")
TRANSFER_TARGET = 1
"""Under CompleteP the best lr may move by at most this many grid steps across the widths."""
TOKENS_TARGET = 0.8
"""Muon must reach the target held-out loss in at most this fraction of AdamW's tokens."""
DIVERGENCE_NATS = 1.0
"""A run whose training loss exceeds its first step's loss by more than this is stopped as diverged."""


@dataclass(frozen=True)
class Settings:
    """Model shapes, data geometry, schedule, grids and the evaluation protocol shared by every run."""

    widths: tuple[int, ...] = (64, 128, 256)
    base_width: int = 64
    num_layers: int = 4
    base_layers: int = 4
    head_dim: int = 32
    seq_len: int = 256
    batch_tokens: int = 4096
    micro_batch_tokens: int = 1024
    steps: int = 100
    warmup: float = 0.1
    decay: float = 0.2
    init_std: float = 0.02
    weight_decay: float = 0.1
    seed: int = 0
    attn: str = "sdpa_loop"
    lr_exps: tuple[int, ...] = (-9, -8, -7, -6)
    """AdamW learning rates of the LR-transfer grid, as base-2 exponents."""
    muon_width: int = 128
    muon_lr_exps: tuple[int, ...] = (-8, -7, -6, -5)
    """Muon learning rates, as base-2 exponents."""
    max_extend: int = 2
    """Grid steps that may be added on a side where the best lr sits at the edge of the lrs tried."""
    eval_tokens: int = 16384
    eval_every: int = 5
    """Steps between held-out evaluations of the Muon-vs-AdamW runs (the others are evaluated at the end)."""
    target_margin: float = 0.02
    threads: int = 2

    def intermediate(self, width: int) -> int:
        """SwiGLU intermediate size: 8/3 x width, rounded to a multiple of 32."""
        return max(32, round(8 * width / 3 / 32) * 32)

    def train_config(self, run: RunKey, data_dir: Path, output_dir: str) -> TrainConfig:
        """The lmforge config of one run."""
        return TrainConfig.model_validate(
            {
                "max_steps": self.steps,
                "output_dir": output_dir,
                "tokenizer": {"name": str(data_dir / "tokenizer")},
                "model": {
                    "arch": {
                        "model_type": "llama",
                        "hidden_size": run.width,
                        "intermediate_size": self.intermediate(run.width),
                        "num_hidden_layers": self.num_layers,
                        "num_attention_heads": run.width // self.head_dim,
                        "max_position_embeddings": self.seq_len,
                    },
                    "init": {
                        "scheme": run.scheme,
                        "std": self.init_std,
                        "seed": self.seed,
                        "base_hidden_size": self.base_width,
                        "base_num_layers": self.base_layers,
                    },
                    "attn": self.attn,
                    "param_dtype": "float32",
                },
                "data": {
                    "type": "tokens",
                    "paths": [str(data_dir / "train")],
                    "seq_len": self.seq_len,
                    "batch_tokens": self.batch_tokens,
                    "micro_batch_tokens": self.micro_batch_tokens,
                    "document_masking": True,
                    "seed": self.seed,
                    "max_epochs": 1000,
                },
                "optim": {"type": run.optimizer, "lr": 2.0**run.lr_exp, "weight_decay": self.weight_decay},
                "schedule": {"warmup": self.warmup, "decay": self.decay},
                "ckpt": {"final": False},
            }
        )


SMOKE = Settings(
    widths=(32, 64),
    base_width=32,
    num_layers=2,
    base_layers=2,
    seq_len=128,
    batch_tokens=512,
    micro_batch_tokens=256,
    steps=4,
    lr_exps=(-8, -7),
    muon_width=32,
    muon_lr_exps=(-8, -7),
    max_extend=0,
    eval_tokens=1024,
    eval_every=2,
)
"""Tiny widths, 2 lrs and 4 steps: checks the whole script runs, in seconds."""


@dataclass(frozen=True, order=True)
class RunKey:
    """What tells one training run from another."""

    optimizer: str
    scheme: str
    width: int
    lr_exp: int


@dataclass
class Run:
    """The figures of one training run."""

    key: RunKey
    heldout_loss: float
    """Held-out loss after the last step trained (NaN if not finite)."""
    train_loss: float
    """Training loss of the last step trained."""
    steps: int
    """Steps trained (fewer than asked when the run diverged)."""
    diverged: bool
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(tokens trained, held-out loss) at each evaluation, from 0 tokens on (only for the Muon-vs-AdamW runs)."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {**asdict(self.key), "lr": 2.0**self.key.lr_exp, **{k: v for k, v in asdict(self).items() if k != "key"}}


def rank_loss(run: Run) -> float:
    """The loss that ranks learning rates: the held-out loss, a diverged or non-finite run last."""
    return math.inf if run.diverged or not math.isfinite(run.heldout_loss) else run.heldout_loss


# ---------------------------------------------------------------------------------------------- training


def heldout_batches(settings: Settings, data_dir: Path) -> list[MicroBatch]:
    """A fixed set of held-out micro-batches (`eval_tokens` tokens of `data/demo/heldout` windows)."""
    cfg = TokensDataConfig(
        paths=[str(data_dir / "heldout")],
        seq_len=settings.seq_len,
        batch_tokens=settings.eval_tokens,
        micro_batch_tokens=settings.micro_batch_tokens,
        document_masking=True,
        seed=settings.seed,
    )
    return TokenData(cfg, 0, 1, load_tokenizer(str(data_dir / "tokenizer"))).next_step()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches: list[MicroBatch], device: torch.device) -> float:
    """Mean cross-entropy over every loss token of the held-out micro-batches."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for mb in batches:
        on_device = {k: v if k == "seq_lens" else v.to(device) for k, v in mb.items()}
        total += token_loss_sum(model, on_device).double()
        count += int(mb["loss_mask"].sum())
    loss = float(total) / max(count, 1)
    return loss if math.isfinite(loss) else math.nan


class Runner:
    """Trains runs on demand and keeps their figures; identical runs are trained once."""

    def __init__(
        self, settings: Settings, data_dir: Path, ctx: DistContext, tmp: Path, log: Callable[[str], None]
    ) -> None:
        """`tmp` holds the run folders (config and metrics only: no checkpoints); `log` gets a line per run."""
        self.settings = settings
        self.data_dir = data_dir
        self.ctx = ctx
        self.tmp = tmp
        self.log = log
        self.heldout = heldout_batches(settings, data_dir)
        self.runs: dict[RunKey, Run] = {}

    def canonical(self, key: RunKey) -> RunKey:
        """The run that trains the same model: at the base shape CompleteP is the standard parameterization."""
        s = self.settings
        if key.scheme == "completep" and key.width == s.base_width and s.num_layers == s.base_layers:
            return replace(key, scheme="normal")
        return key

    def wants_curve(self, key: RunKey) -> bool:
        """Whether a run feeds the Muon-vs-AdamW comparison (held-out loss every `eval_every` steps)."""
        return key.scheme == "normal" and key.width == self.settings.muon_width

    def get(self, key: RunKey) -> Run:
        """The figures of a run, training it first if it has not been trained."""
        key = self.canonical(key)
        if key not in self.runs:
            self.runs[key] = self.train(key)
        return self.runs[key]

    def train(self, key: RunKey) -> Run:
        """Train one run from scratch and evaluate it."""
        s = self.settings
        t0 = time.perf_counter()
        config = s.train_config(key, self.data_dir, str(self.tmp / "run"))
        check_config(config, self.ctx.world_size)
        prepare_output_dir(config, overwrite=True)
        trainer = Trainer(config, self.ctx, console=False)
        curve_every = s.eval_every if self.wants_curve(key) else None
        curve: list[tuple[int, float]] = []
        first = train_loss = math.nan
        diverged = False
        step = 0
        try:
            if curve_every is not None:
                curve.append((0, heldout_loss(trainer.model, self.heldout, self.ctx.device)))
            while step < s.steps:
                metrics = trainer.train_step(trainer.data.next_step(), 0.0)
                step += 1
                train_loss = metrics["loss/mean"]
                first = train_loss if step == 1 else first
                diverged = not math.isfinite(train_loss) or train_loss > first + DIVERGENCE_NATS
                if curve_every is not None and (step % curve_every == 0 or step == s.steps) and not diverged:
                    curve.append((int(metrics["progress/num_tokens"]), self._eval(trainer)))
                if diverged:
                    break
            final = curve[-1][1] if curve and curve[-1][0] == step * s.batch_tokens else self._eval(trainer)
        finally:
            trainer.close()
        run = Run(key, final, train_loss, step, diverged, curve, time.perf_counter() - t0)
        base = key.scheme == "normal" and self.canonical(replace(key, scheme="completep")) == key
        shared = " (= completep)" if base else ""
        self.log(
            f"{key.optimizer:>5} {key.scheme:>9}{shared} d{key.width:<4} lr 2^{key.lr_exp:<3}: held-out "
            f"{run.heldout_loss:.4f}, train {train_loss:.4f}, {step} steps"
            f"{' [red]diverged[/]' if diverged else ''} ({run.seconds:.0f} s)"
        )
        return run

    def _eval(self, trainer: Trainer) -> float:
        return heldout_loss(trainer.model, self.heldout, self.ctx.device)

    def search(self, optimizer: str, scheme: str, width: int, exps: tuple[int, ...]) -> dict[int, Run]:
        """Runs at each lr exponent of the grid, extended one step at a time (at most `max_extend` per side) on the
        side where the best lr sits at the edge, so that a worse lr brackets it on both sides where possible."""
        tried = sorted(set(exps))
        runs = {e: self.get(RunKey(optimizer, scheme, width, e)) for e in tried}
        extended = {-1: 0, 1: 0}
        while True:
            best = min(runs, key=lambda e: (rank_loss(runs[e]), e))
            side = -1 if best == min(runs) else 1 if best == max(runs) else 0
            if side == 0 or extended[side] >= self.settings.max_extend or math.isinf(rank_loss(runs[best])):
                return dict(sorted(runs.items()))
            extended[side] += 1
            e = best + side
            runs[e] = self.get(RunKey(optimizer, scheme, width, e))


# ---------------------------------------------------------------------------------------------- analysis


def best_exp(runs: dict[int, Run]) -> int | None:
    """The lr exponent with the lowest held-out loss (None if every run diverged)."""
    finite = {e: r for e, r in runs.items() if math.isfinite(rank_loss(r))}
    return min(finite, key=lambda e: (rank_loss(finite[e]), e)) if finite else None


def tokens_to_target(curve: list[tuple[int, float]], target: float) -> float | None:
    """Tokens at which a held-out curve first reaches `target`, interpolated linearly between evaluations."""
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if math.isfinite(l1) and l1 <= target:
            if not math.isfinite(l0) or l0 == l1:
                return float(t1)
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return float(curve[0][0]) if curve and curve[0][1] <= target else None


def transfer_summary(grids: dict[str, dict[int, dict[int, Run]]]) -> dict[str, Any]:
    """Best lr per (scheme, width), whether it is bracketed, and its spread across widths in grid steps."""
    out: dict[str, Any] = {}
    for scheme, by_width in grids.items():
        per_width: dict[str, Any] = {}
        bests = []
        for width, runs in by_width.items():
            b = best_exp(runs)
            per_width[str(width)] = {
                "best_lr_exp": b,
                "best_lr": 2.0**b if b is not None else None,
                "best_loss": runs[b].heldout_loss if b is not None else None,
                "bracketed": b is not None and min(runs) < b < max(runs),
                "lr_exps": sorted(runs),
            }
            if b is not None:
                bests.append(b)
        spread = max(bests) - min(bests) if len(bests) == len(by_width) else None
        out[scheme] = {"widths": per_width, "spread_steps": spread}
    cp = out.get("completep", {}).get("spread_steps")
    out["target_steps"] = TRANSFER_TARGET
    out["pass"] = cp is not None and cp <= TRANSFER_TARGET
    return out


def muon_summary(settings: Settings, grids: dict[str, dict[int, Run]]) -> dict[str, Any]:
    """Each optimizer at its best lr: final loss and tokens to the target loss (AdamW's final + margin)."""
    out: dict[str, Any] = {"width": settings.muon_width, "margin": settings.target_margin}
    bests = {opt: best_exp(runs) for opt, runs in grids.items()}
    adamw_best = bests["adamw"]
    target = grids["adamw"][adamw_best].heldout_loss + settings.target_margin if adamw_best is not None else math.nan
    out["target_loss"] = target
    for opt, runs in grids.items():
        b = bests[opt]
        tokens = tokens_to_target(runs[b].curve, target) if b is not None and math.isfinite(target) else None
        out[opt] = {
            "best_lr_exp": b,
            "best_lr": 2.0**b if b is not None else None,
            "final_loss": runs[b].heldout_loss if b is not None else None,
            "bracketed": b is not None and min(runs) < b < max(runs),
            "lr_exps": sorted(runs),
            "reached": tokens is not None,
            "tokens_to_target": tokens,
            "curve": runs[b].curve if b is not None else [],
        }
    a, m = out["adamw"]["tokens_to_target"], out["muon"]["tokens_to_target"]
    out["ratio"] = m / a if a and m is not None else None
    out["target_ratio"] = TOKENS_TARGET
    out["pass"] = out["ratio"] is not None and out["ratio"] <= TOKENS_TARGET
    return out


# ---------------------------------------------------------------------------------------------- report


def _verdict(ok: bool) -> str:
    return "[green]PASS[/]" if ok else "[red]MISS[/]"


def _lr(e: int) -> str:
    return f"2^{e} = {2.0**e:.2e}"


def _cell(run: Run | None, best: bool) -> str:
    if run is None:
        return "-"
    if run.diverged:
        return f"[red]div. ({run.steps})[/]"
    text = f"{run.heldout_loss:.4f}"
    return f"[bold green]{text}[/]" if best else text


def print_transfer(settings: Settings, grids: dict[str, dict[int, dict[int, Run]]], summary: dict[str, Any],
                   console: Console) -> None:  # fmt: skip
    """Held-out loss per lr and (scheme, width), the best lr per column, then the spread against the target."""
    s = settings
    table = Table(
        title=(
            f"LR transfer, AdamW: held-out loss after {s.steps} steps x {s.batch_tokens} tokens "
            f"({s.steps * s.batch_tokens:,} tokens), {s.num_layers} layers, CompleteP base d{s.base_width} "
            f"x {s.base_layers} (its d{s.base_width} runs are the normal ones)"
        )
    )
    table.add_column("lr")
    columns = [(scheme, w) for scheme in SCHEMES for w in s.widths]
    for scheme, w in columns:
        table.add_column(f"{scheme}\nd{w}", justify="right")
    exps = sorted({e for by_width in grids.values() for runs in by_width.values() for e in runs})
    for e in exps:
        cells = []
        for scheme, w in columns:
            runs = grids[scheme][w]
            cells.append(_cell(runs.get(e), summary[scheme]["widths"][str(w)]["best_lr_exp"] == e))
        table.add_row(_lr(e), *cells)
    table.add_section()
    row = []
    for scheme, w in columns:
        b = summary[scheme]["widths"][str(w)]
        row.append("-" if b["best_lr_exp"] is None else f"2^{b['best_lr_exp']}" + ("" if b["bracketed"] else " (edge)"))
    table.add_row("best lr", *row)
    console.print(table)
    spread = Table(title="Best lr across widths (a grid step is 2x)")
    spread.add_column("scheme")
    for w in s.widths:
        spread.add_column(f"best lr d{w}", justify="right")
    spread.add_column("spread (grid steps)", justify="right")
    spread.add_column("target", justify="right")
    for scheme in SCHEMES:
        per = summary[scheme]["widths"]
        cells = [f"2^{per[str(w)]['best_lr_exp']}" if per[str(w)]["best_lr_exp"] is not None else "-" for w in s.widths]
        steps = summary[scheme]["spread_steps"]
        verdict = ""
        if scheme == "completep":
            verdict = f"<= {TRANSFER_TARGET} {_verdict(summary['pass'])}"
        spread.add_row(scheme, *cells, "-" if steps is None else str(steps), verdict)
    console.print(spread)
    unbracketed = [f"{scheme} d{w}" for scheme in SCHEMES for w in s.widths
                   if not summary[scheme]["widths"][str(w)]["bracketed"]]  # fmt: skip
    if unbracketed:
        console.print(
            f"[yellow]best lr at the edge of the lrs tried (not bracketed): {', '.join(unbracketed)}; widen --lrs "
            "or raise --max-extend[/]"
        )


def print_muon(settings: Settings, grids: dict[str, dict[int, Run]], summary: dict[str, Any], console: Console) -> None:
    """Each optimizer's grid and best lr, tokens to the target loss and the ratio; then the two best curves."""
    s = settings
    table = Table(
        title=(
            f"Muon vs AdamW at d{s.muon_width} (standard parameterization): held-out loss after {s.steps} steps; "
            f"target {summary['target_loss']:.4f} = AdamW's best final + {s.target_margin}"
        )
    )
    table.add_column("optimizer")
    table.add_column("held-out loss per lr", justify="left")
    table.add_column("best lr", justify="right")
    table.add_column("final loss", justify="right")
    table.add_column("tokens to target", justify="right")
    for opt in OPTIMIZERS:
        o = summary[opt]
        grid = ", ".join(
            f"2^{e}: {'div.' if r.diverged else f'{r.heldout_loss:.4f}'}" for e, r in sorted(grids[opt].items())
        )
        tokens = f"{o['tokens_to_target']:,.0f}" if o["reached"] else "not reached"
        best = "-" if o["best_lr_exp"] is None else f"2^{o['best_lr_exp']}" + ("" if o["bracketed"] else " (edge)")
        final = "-" if o["final_loss"] is None else f"{o['final_loss']:.4f}"
        table.add_row(opt, grid, best, final, tokens)
    table.add_section()
    ratio = summary["ratio"]
    ratio_text = "-" if ratio is None else f"{ratio:.3f}x"
    table.add_row("muon / adamw", "", "", "", f"{ratio_text} {_verdict(summary['pass'])}")
    table.add_row("target", "", "", "", f"<= {TOKENS_TARGET}x")
    console.print(table)
    curves = {opt: dict(summary[opt]["curve"]) for opt in OPTIMIZERS}
    if all(curves.values()):
        ct = Table(title=f"Held-out loss during training at the best lr (d{s.muon_width})")
        ct.add_column("tokens", justify="right")
        for opt in OPTIMIZERS:
            ct.add_column(opt, justify="right")
        for t in sorted(set(curves["adamw"]) | set(curves["muon"])):
            ct.add_row(f"{t:,}", *(f"{curves[o][t]:.4f}" if t in curves[o] else "-" for o in OPTIMIZERS))
        console.print(ct)


# ---------------------------------------------------------------------------------------------- main


def _exp_range(values: list[int] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    lo, hi = sorted(values)
    return tuple(range(lo, hi + 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=None,
        help="hidden sizes, multiples of 32 (default 64 128 256; smoke 32 64)",
    )
    p.add_argument("--base-width", type=int, default=None, help="CompleteP base width (default 64; smoke 32)")
    p.add_argument(
        "--muon-width", type=int, default=None, help="width of the Muon-vs-AdamW comparison (default 128; smoke 32)"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 100; smoke 4)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 4096; smoke 512)")
    p.add_argument(
        "--lrs",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="AdamW lr grid, base-2 exponents LO..HI (default -9 -6; smoke -8 -7)",
    )
    p.add_argument(
        "--muon-lrs",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="Muon lr grid, base-2 exponents LO..HI (default -8 -5; smoke -8 -7)",
    )
    p.add_argument(
        "--max-extend",
        type=int,
        default=None,
        help="grid steps that may be added on a side where the best lr is at the edge\n(default 2; smoke 0)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between held-out evaluations of the Muon-vs-AdamW runs (default 5)",
    )
    p.add_argument(
        "--target-margin",
        type=float,
        default=None,
        help="target held-out loss = AdamW's best final loss + this (default 0.02)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("data/demo"),
        help="demo data folder (tokenizer, train, heldout), built there if missing\n(default data/demo)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    p.add_argument("--smoke", action="store_true", help="widths 32 and 64, 2 lrs, 4 steps: checks the script runs")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The chosen size's settings with the flags applied."""
    base = SMOKE if args.smoke else Settings()
    changes: dict[str, Any] = {"threads": args.threads}
    if args.widths is not None:
        changes["widths"] = tuple(args.widths)
    for name in ("base_width", "muon_width", "steps", "batch_tokens", "max_extend", "eval_every", "target_margin"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.lrs is not None:
        changes["lr_exps"] = _exp_range(args.lrs)
    if args.muon_lrs is not None:
        changes["muon_lr_exps"] = _exp_range(args.muon_lrs)
    return replace(base, **changes)


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, train every run, print the tables, optionally write the JSON."""
    args = parse_args(argv)
    settings = settings_from_args(args)
    s = settings
    if s.steps < 1 or s.threads < 1 or s.max_extend < 0 or s.eval_every < 1:
        print("lr_transfer.py: --steps, --threads and --eval-every must be >= 1, --max-extend >= 0", file=sys.stderr)
        return 2
    if any(w % s.head_dim for w in (*s.widths, s.base_width, s.muon_width)):
        print(f"lr_transfer.py: widths must be multiples of the head size {s.head_dim}", file=sys.stderr)
        return 2
    if s.batch_tokens % s.micro_batch_tokens or s.eval_tokens % s.micro_batch_tokens:
        print(f"lr_transfer.py: --batch-tokens must be a multiple of {s.micro_batch_tokens}", file=sys.stderr)
        return 2
    torch.set_num_threads(s.threads)
    console = Console(width=None if sys.stdout.isatty() else 120)  # no wrapping in logs and pipes
    prepare_demo_data(args.data_dir, console)
    t0 = time.perf_counter()
    ctx = init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix="lmforge-lr-transfer-") as tmp:
            runner = Runner(s, args.data_dir, ctx, Path(tmp), lambda line: console.print(line, highlight=False))
            transfer = {
                scheme: {w: runner.search("adamw", scheme, w, s.lr_exps) for w in s.widths} for scheme in SCHEMES
            }
            muon = {
                "adamw": runner.search("adamw", "normal", s.muon_width, s.lr_exps),
                "muon": runner.search("muon", "normal", s.muon_width, s.muon_lr_exps),
            }
    finally:
        shutdown_distributed()
    wall = time.perf_counter() - t0
    summary = {
        "settings": asdict(s),
        "runs": [r.as_dict() for r in sorted(runner.runs.values(), key=lambda r: r.key)],
        "transfer": transfer_summary(transfer),
        "muon": muon_summary(s, muon),
        "wall_s": wall,
    }
    print_transfer(s, transfer, summary["transfer"], console)
    print_muon(s, muon, summary["muon"], console)
    console.print(f"{len(runner.runs)} runs in {wall / 60:.1f} min", highlight=False)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
