"""What the learning-rate transfer benchmark (`lr_transfer.py`) reads off its runs, and the tables it prints:
the best lr per (scheme, width) and its spread across widths, and Muon against AdamW in tokens to a target loss.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from rich.console import Console

import common
from lr_transfer_config import OPTIMIZERS, SCHEMES, Settings
from lr_transfer_sweep import Run, rank_loss

TRANSFER_TARGET = 1
"""Under CompleteP the best lr may move by at most this many grid steps across the widths."""
TOKENS_TARGET = 0.8
"""Muon must reach the target held-out loss in at most this fraction of AdamW's tokens."""


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


# ---------------------------------------------------------------------------------------------- tables


def _lr(e: int) -> str:
    """An lr of the grid: its exponent and its value."""
    return f"2^{e} = {2.0**e:.2e}"


def _best(entry: dict[str, Any]) -> str:
    """The best lr of a summary entry, marked when no worse lr brackets it on one side."""
    if entry["best_lr_exp"] is None:
        return "-"
    return f"2^{entry['best_lr_exp']}" + ("" if entry["bracketed"] else " (edge)")


def _cell(run: Run | None, best: bool) -> str:
    """A run's held-out loss in the grid table: highlighted at the best lr, marked where the run diverged."""
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
    title = (
        f"LR transfer, AdamW: held-out loss after {s.steps} steps x {s.batch_tokens} tokens "
        f"({s.steps * s.batch_tokens:,} tokens), {s.num_layers} layers, CompleteP base d{s.base_width} "
        f"x {s.base_layers} (its d{s.base_width} runs are the normal ones)"
    )
    columns = [(scheme, w) for scheme in SCHEMES for w in s.widths]
    table = common.result_table(title, ["lr", *(f"{scheme}\nd{w}" for scheme, w in columns)])
    exps = sorted({e for by_width in grids.values() for runs in by_width.values() for e in runs})
    for e in exps:
        cells = []
        for scheme, w in columns:
            runs = grids[scheme][w]
            cells.append(_cell(runs.get(e), summary[scheme]["widths"][str(w)]["best_lr_exp"] == e))
        table.add_row(_lr(e), *cells)
    table.add_section()
    table.add_row("best lr", *(_best(summary[scheme]["widths"][str(w)]) for scheme, w in columns))
    console.print(table)
    spread_columns = ["scheme", *(f"best lr d{w}" for w in s.widths), "spread (grid steps)", "target"]
    spread = common.result_table("Best lr across widths (a grid step is 2x)", spread_columns)
    for scheme in SCHEMES:
        per = summary[scheme]["widths"]
        cells = [f"2^{per[str(w)]['best_lr_exp']}" if per[str(w)]["best_lr_exp"] is not None else "-" for w in s.widths]
        steps = summary[scheme]["spread_steps"]
        target = f"<= {TRANSFER_TARGET} {common.verdict(summary['pass'])}" if scheme == "completep" else ""
        spread.add_row(scheme, *cells, "-" if steps is None else str(steps), target)
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
    title = (
        f"Muon vs AdamW at d{s.muon_width} (standard parameterization): held-out loss after {s.steps} steps; "
        f"target {summary['target_loss']:.4f} = AdamW's best final + {s.target_margin}"
    )
    columns = ("optimizer", "held-out loss per lr", "best lr", "final loss", "tokens to target")
    table = common.result_table(title, columns, left=columns[:2])
    for opt in OPTIMIZERS:
        o = summary[opt]
        grid = ", ".join(
            f"2^{e}: {'div.' if r.diverged else f'{r.heldout_loss:.4f}'}" for e, r in sorted(grids[opt].items())
        )
        tokens = f"{o['tokens_to_target']:,.0f}" if o["reached"] else "not reached"
        final = "-" if o["final_loss"] is None else f"{o['final_loss']:.4f}"
        table.add_row(opt, grid, _best(o), final, tokens)
    table.add_section()
    ratio = summary["ratio"]
    ratio_text = "-" if ratio is None else f"{ratio:.3f}x"
    table.add_row("muon / adamw", "", "", "", f"{ratio_text} {common.verdict(summary['pass'])}")
    table.add_row("target", "", "", "", f"<= {TOKENS_TARGET}x")
    console.print(table)
    curves = {opt: dict(summary[opt]["curve"]) for opt in OPTIMIZERS}
    if all(curves.values()):
        title = f"Held-out loss during training at the best lr (d{s.muon_width})"
        ct = common.result_table(title, ["tokens", *OPTIMIZERS], left=())
        for t in sorted(set(curves["adamw"]) | set(curves["muon"])):
            ct.add_row(f"{t:,}", *(f"{curves[o][t]:.4f}" if t in curves[o] else "-" for o in OPTIMIZERS))
        console.print(ct)
