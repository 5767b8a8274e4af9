"""One self-contained HTML page about a run: interactive curves, a summary and its config (`lmforge report`)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from lmforge.viz.runs import Run, ema, load_run, select_metrics
from lmforge.viz.spikes import Spike, flagged_steps, spikes_html

DEFAULT_SMOOTHING = 0.9
CHART_HEIGHT = 420  # pixels, legend included
MAX_COLUMNS = 2  # charts side by side in a panel


@dataclass(frozen=True)
class Chart:
    """One chart of a panel: the metrics (glob patterns) it draws, in that order.

    `spikes` names a flag metric (non-zero on a flagged step) whose steps are marked on the chart's first metric;
    `smooth` adds an EMA line over each metric; `log_y` suits metrics that span orders of magnitude.
    """

    title: str
    patterns: tuple[str, ...]
    spikes: str | None = None
    smooth: bool = False
    log_y: bool = False


@dataclass(frozen=True)
class Panel:
    """A section of the report, shown only when the run logged a metric one of its charts draws."""

    id: str
    title: str
    charts: tuple[Chart, ...]


# Validation charts are built from the run's own val/* names (see `_val_charts`), so that panel lists none here.
PANELS: tuple[Panel, ...] = (
    Panel("panel-loss", "Loss", (Chart("loss/mean", ("loss/mean",), spikes="loss/spike", smooth=True),)),
    Panel("panel-lr", "Learning rate", (Chart("learning rate", ("optim/lr", "optim/lr/*")),)),
    Panel(
        "panel-grad-norm",
        "Gradient norms",
        (Chart("gradient norm", ("optim/grad_norm", "optim/grad_norm/*"), spikes="optim/grad_norm_spike", log_y=True),),
    ),
    Panel(
        "panel-throughput",
        "Throughput and MFU",
        (
            Chart("tokens / s", ("perf/throughput", "perf/throughput_per_device")),
            Chart("MFU", ("perf/mfu", "perf/mfu_6nd")),
        ),
    ),
    Panel(
        "panel-memory",
        "Memory and timing",
        (
            Chart("peak memory (GiB)", ("perf/peak_memory",)),
            Chart("seconds", ("time/step", "time/data/*", "time/val", "time/save_ckpt")),
        ),
    ),
    Panel("panel-val", "Validation", ()),
    Panel(
        "panel-moe",
        "Mixture of experts",
        (
            Chart("max violation", ("max_vio/*",)),
            Chart("routing confidence", ("routing_confidence/*",)),
            Chart("expert load", ("expert_load/*",)),
            Chart("router bias and other MoE metrics", ("moe/*",)),
        ),
    ),
)
PANEL_IDS: tuple[str, ...] = tuple(p.id for p in PANELS)


VAL_KIND_ORDER = ("loss", "perplexity", "bpb", "acc", "acc_norm")  # the validation charts first, other kinds after


def _val_kind(name: str) -> str:
    # val/loss, val/<set>/loss@2048 -> loss; val/perplexity and .../ppl@... share a chart
    kind = name.rsplit("/", 1)[-1].split("@", 1)[0]
    return "perplexity" if kind == "ppl" else kind


def _val_charts(names: Sequence[str]) -> tuple[Chart, ...]:
    kinds: dict[str, list[str]] = {}
    for name in names:
        if name.startswith("val/"):
            kinds.setdefault(_val_kind(name), []).append(name)
    order = {kind: i for i, kind in enumerate(VAL_KIND_ORDER)}
    ranked = sorted(kinds, key=lambda k: (order.get(k, len(order)), k))
    return tuple(Chart(f"validation {kind}", tuple(kinds[kind])) for kind in ranked)


def _panel_charts(panel: Panel, names: Sequence[str]) -> list[tuple[Chart, list[str]]]:
    """The panel's charts that have something to draw in this run, each with the metric names it draws."""
    charts = _val_charts(names) if panel.id == "panel-val" else panel.charts
    out = []
    for chart in charts:
        hits = select_metrics(names, chart.patterns)
        drawn = list(dict.fromkeys(n for p in chart.patterns for n in hits[p]))
        if drawn:
            out.append((chart, drawn))
    return out


# plotly's default colour sequence, named here so that a metric's raw and smoothed lines can share a colour
COLOURS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff", "#fecb52")
MAX_LEGEND_ENTRIES = 12  # past that (per-expert loads, say) the legend would hide the chart; hovering still names lines


def chart_figure(run: Run, chart: Chart, names: Sequence[str], smoothing: float) -> go.Figure:
    """The figure of one chart: a line per metric in `names` (and its EMA when the chart smooths), flagged steps."""
    fig = go.Figure()
    for i, name in enumerate(names):
        steps, values = run.series(name)
        colour = COLOURS[i % len(COLOURS)]
        if chart.smooth and smoothing > 0:
            raw = go.Scatter(
                x=steps, y=values, name=name, mode="lines", opacity=0.35, line={"width": 1, "color": colour}
            )
            fig.add_trace(raw)
            label = f"{name} (EMA {smoothing:g})"
            line = {"width": 2, "color": colour}
            fig.add_trace(go.Scatter(x=steps, y=ema(values, smoothing), name=label, mode="lines", line=line))
        else:
            fig.add_trace(go.Scatter(x=steps, y=values, name=name, mode="lines", line={"color": colour}))
    if chart.spikes is not None:
        flagged = {s for s, v in zip(*run.series(chart.spikes), strict=True) if v > 0}
        marks = [(s, v) for s, v in zip(*run.series(names[0]), strict=True) if s in flagged]
        if marks:
            spike = go.Scatter(
                x=[s for s, _ in marks],
                y=[v for _, v in marks],
                name=f"{chart.spikes} (flagged steps)",
                mode="markers",
                marker={"symbol": "x", "size": 10, "color": "crimson"},
            )
            fig.add_trace(spike)
    fig.update_layout(
        title={"text": chart.title, "x": 0.5},
        height=CHART_HEIGHT,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
        hovermode="x unified",
        showlegend=len(fig.data) <= MAX_LEGEND_ENTRIES,
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "xanchor": "left", "x": 0},
        xaxis={"title": {"text": "step"}},
        yaxis={"type": "log" if chart.log_y else "linear", "exponentformat": "SI"},
    )
    return fig


def _fmt_number(x: float) -> str:
    if x == int(x) and abs(x) >= 1000:
        n = int(x)
        for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
            if abs(n) >= scale:
                return f"{n / scale:.3g}{suffix} ({n:,})"
    if x == int(x):
        return str(int(x))
    return f"{x:.6g}"


def _last(run: Run, name: str) -> tuple[int, float] | None:
    steps, values = run.series(name)
    return (steps[-1], values[-1]) if steps else None


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """(label, value) rows of the run summary: steps, tokens, final loss, best validation loss, params/*."""
    rows: list[tuple[str, str]] = [("run", run.name), ("directory", str(run.path))]
    if run.records:
        trained = [r["step"] for r in run.records if any(not k.startswith("params/") for k in r if k != "step")]
        last_step = max(trained) if trained else max(r["step"] for r in run.records)
        rows.append(("steps", f"{last_step} ({len(run.records)} records logged)"))
    else:
        rows.append(("steps", "none logged yet"))
    if (tokens := _last(run, "progress/num_tokens")) is not None:
        rows.append(("tokens", _fmt_number(tokens[1])))
    if (loss := _last(run, "loss/mean")) is not None:
        rows.append(("final loss", f"{loss[1]:.4f} (step {loss[0]})"))
    steps, values = run.series("val/loss")
    if values:
        best = min(range(len(values)), key=values.__getitem__)
        rows.append(("best val loss", f"{values[best]:.4f} (step {steps[best]})"))
    for name in run.metric_names():
        if name.startswith("params/"):
            # logged once, at step 0; the first value is the one
            rows.append((name, _fmt_number(run.series(name)[1][0])))
    return rows


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin: 1.2em 0 0.3em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } td { padding: 0.2em 1em 0.2em 0; vertical-align: top; }
td:first-child { color: #555; } pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
.note { color: #555; font-size: 0.9em; } h3 { font-size: 1em; margin: 0.8em 0 0.2em; }
.snippet { font-family: monospace; white-space: pre-wrap; word-break: break-word; }
.charts { display: grid; gap: 0.5em 1em; } .chart { min-width: 0; }
@media (max-width: 1000px) { .charts { grid-template-columns: minmax(0, 1fr) !important; } }
"""


def render_report(run: Run, smoothing: float = DEFAULT_SMOOTHING, spikes: Sequence[Spike] | None = None) -> str:
    """The report page of `run` as one HTML document, plotly.js included once, inline: it opens offline. The spike
    section lists `spikes` (flagged steps with their documents) when given, else the flagged steps alone."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    names = run.metric_names()
    title = f"lmforge run report: {run.name}"
    body: list[str] = [f"<h1>{html.escape(title)}</h1>", '<div id="run-summary"><h2>Summary</h2><table>']
    body += [f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(run)]
    body.append("</table></div>")
    flagged = flagged_steps(run) if spikes is None else list(spikes)
    if flagged:
        body.append(spikes_html(flagged, replayed=spikes is not None))
    shown: set[str] = set()
    for panel in PANELS:
        charts = _panel_charts(panel, names)
        if not charts:
            continue
        shown.update(n for _, drawn in charts for n in drawn)
        shown.update(c.spikes for c, _ in charts if c.spikes)
        graphs = [
            chart_figure(run, chart, drawn, smoothing).to_html(
                full_html=False,
                include_plotlyjs=False,
                div_id=f"graph-{panel.id.removeprefix('panel-')}-{i}",
                config={"displaylogo": False, "responsive": True},
            )
            for i, (chart, drawn) in enumerate(charts)
        ]
        # The column count is fixed before the charts are parsed: each is sized to its cell as its script runs.
        columns = f"grid-template-columns: repeat({min(MAX_COLUMNS, len(charts))}, minmax(0, 1fr))"
        charts_html = "".join(f'<div class="chart">{g}</div>' for g in graphs)
        body.append(
            f'<div class="panel" id="{panel.id}"><h2>{html.escape(panel.title)}</h2>'
            f'<div class="charts" style="{columns}">{charts_html}</div></div>'
        )
    rest = [n for n in names if n not in shown and not n.startswith("params/")]
    if rest:
        body.append(f'<p class="note" id="unplotted">Logged but not plotted: {html.escape(", ".join(rest))}.</p>')
    body.append('<div id="run-config"><h2>config.toml</h2>')
    if run.config_text is None:
        body.append('<p class="note">The run directory has no config.toml.</p>')
    else:
        body.append(f"<pre>{html.escape(run.config_text)}</pre>")
    body.append("</div>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n"
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head>\n<body>\n'
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def write_report(
    run_dir: str | Path, output: Path, smoothing: float = DEFAULT_SMOOTHING, spikes: Sequence[Spike] | None = None
) -> Path:
    """Write the report of the run in `run_dir` to `output` (see `render_report`); returns `output`.

    Raises `RunError` when the run directory cannot be read.
    """
    page = render_report(load_run(run_dir), smoothing, spikes)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page, encoding="utf-8")
    return output
