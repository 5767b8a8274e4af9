"""Where metrics go: the console, metrics.jsonl, and (later) W&B."""

from lmforge.monitor.base import Monitor, Monitors
from lmforge.monitor.console import ConsoleMonitor
from lmforge.monitor.jsonl import JsonlMonitor, read_metrics

__all__ = ["ConsoleMonitor", "JsonlMonitor", "Monitor", "Monitors", "read_metrics"]
