"""Where metrics go: the console, metrics.jsonl (the run's record), and W&B."""

from lmforge.monitor.base import Monitor, Monitors, RecordError
from lmforge.monitor.console import ConsoleMonitor
from lmforge.monitor.jsonl import JsonlMonitor, read_metrics

__all__ = ["ConsoleMonitor", "JsonlMonitor", "Monitor", "Monitors", "RecordError", "read_metrics"]
