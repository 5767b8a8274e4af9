"""Looking at runs: curves of several runs in one image (`plot_runs`, behind `lmforge plot`) and a run's HTML report
(`write_report`, behind `lmforge report`)."""

from lmforge.viz.plot import PlotError, plot_runs
from lmforge.viz.report import PANEL_IDS, render_report, write_report
from lmforge.viz.runs import Run, RunError, ema, load_run, metric_names, select_metrics, series

__all__ = [
    "PANEL_IDS",
    "PlotError",
    "Run",
    "RunError",
    "ema",
    "load_run",
    "metric_names",
    "plot_runs",
    "render_report",
    "select_metrics",
    "series",
    "write_report",
]
