"""Training curves of one or more runs, overlaid, as a static image (`lmforge plot`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lmforge.viz.runs import Run, ema, load_run, select_metrics

DEFAULT_METRICS = ("loss/mean",)
DEFAULT_SMOOTHING = 0.9
FORMATS = ("png", "svg", "pdf")


class PlotError(ValueError):
    """Bad input to `plot_runs`: a metric pattern that matches nothing, an unsupported output format, no runs."""


def run_labels(runs: Sequence[Run]) -> list[str]:
    """A legend label per run: its folder name, or its path where two runs share a folder name."""
    names = [r.name for r in runs]
    if len(set(names)) == len(names):
        return names
    return [str(r.path) for r in runs]


def matched_metrics(runs: Sequence[Run], patterns: Sequence[str]) -> list[str]:
    """Metric names matched by `patterns` in any run, pattern by pattern, each once; raises `PlotError` naming
    the patterns that match nothing in every run."""
    names = {n for run in runs for n in run.metric_names()}
    by_pattern = select_metrics(names, patterns)
    unmatched = [p for p, hits in by_pattern.items() if not hits]
    if unmatched:
        quoted = ", ".join(repr(p) for p in unmatched)
        raise PlotError(f"no metric matches {quoted} in any run (see the keys of <run>/metrics.jsonl)")
    return list(dict.fromkeys(n for hits in by_pattern.values() for n in hits))


def plot_runs(
    run_dirs: Sequence[str | Path],
    metrics: Sequence[str] = DEFAULT_METRICS,
    output: Path = Path("curves.png"),
    smoothing: float = DEFAULT_SMOOTHING,
) -> list[str]:
    """Draw one subplot per metric matched by the glob `metrics`, every run overlaid, and write the image.

    Each run keeps one colour across subplots: its raw values as a thin transparent line, their EMA (`smoothing`,
    see `ema`) as a solid line. The format follows the suffix of `output` (png, svg or pdf; png when there is none).
    Returns the metric names drawn. Raises `RunError` for an unreadable run and `PlotError` for other bad input.
    """
    if not run_dirs:
        raise PlotError("no run directory given")
    if not metrics:
        raise PlotError("no metric pattern given")
    if not 0.0 <= smoothing < 1.0:
        raise PlotError(f"smoothing must be in [0, 1), got {smoothing}")
    fmt = output.suffix.lstrip(".").lower() or "png"
    if fmt not in FORMATS:
        suffixes = ", ".join("." + f for f in FORMATS)
        raise PlotError(f"cannot write {output}: the output suffix must be one of {suffixes}")
    runs = [load_run(d) for d in run_dirs]
    names = matched_metrics(runs, metrics)
    labels = run_labels(runs)

    ncols = min(3, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)  # rendering stays off-screen whatever backend pyplot may have elsewhere in the process
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, name in zip(axes, names, strict=False):
        for run, label, colour in zip(runs, labels, colours, strict=True):
            steps, values = run.series(name)
            if not steps:
                continue
            if smoothing > 0:
                ax.plot(steps, values, color=colour, linewidth=0.8, alpha=0.3)
                ax.plot(steps, ema(values, smoothing), color=colour, linewidth=1.6, label=label)
            else:
                ax.plot(steps, values, color=colour, linewidth=1.2, label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format=fmt, dpi=110)
    return names
