"""Terminal output with `rich`: a live progress bar and one line every `log.interval` steps."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def format_line(step: int, max_steps: int, m: dict[str, float]) -> str:
    """The console line of a logged step."""
    parts = [f"step {step}/{max_steps}"]
    for key, label, fmt in (
        ("loss/mean", "loss", "{:.4f}"),
        ("optim/lr", "lr", "{:.3e}"),
        ("optim/grad_norm", "grad_norm", "{:.3f}"),
        ("perf/throughput", "tok/s", "{:,.0f}"),
        ("perf/mfu", "mfu", "{:.1%}"),
        ("time/step", "step_s", "{:.3f}"),
        ("loss/nan_count", "nan", "{:.0f}"),
        ("loss/spike", "LOSS SPIKE", ""),
        ("optim/grad_norm_spike", "GRAD SPIKE", ""),
    ):
        if key in m and (key not in ("loss/nan_count", "loss/spike", "optim/grad_norm_spike") or m[key]):
            parts.append(f"{label} {fmt.format(m[key])}".rstrip())
    parts += [
        f"{key} {value:.4f}"
        for key, value in m.items()
        if key == "val/loss" or (key.startswith("val/") and "/loss@" in key)
    ]
    parts += [f"{key.rsplit('/', 1)[1].upper()} FAILED x{value:.0f}" for key, value in m.items()
              if key.startswith("monitor/failures/") and value]  # fmt: skip
    return " | ".join(parts)


class ConsoleMonitor:
    """Progress bar (step, loss, lr, grad norm, tokens/s, ETA) plus a printed line per logged step."""

    name = "console"
    """Name in `monitor/failures/<name>`."""

    def __init__(self, max_steps: int, start_step: int = 0, console: Console | None = None) -> None:
        self.console = console or Console(stderr=False)
        self.max_steps = max_steps
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=max_steps, completed=start_step, status="")
        self.progress.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Advance the bar (every step)."""
        status = (
            f"loss {metrics.get('loss/mean', float('nan')):.4f}  lr {metrics.get('optim/lr', 0.0):.2e}  "
            f"gn {metrics.get('optim/grad_norm', float('nan')):.3f}  {metrics.get('perf/throughput', 0.0):,.0f} tok/s"
        )
        self.progress.update(self.task, completed=step, status=status)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Print the line of a logged step above the bar (the step-0 record: the parameter counts)."""
        if "params/total" in metrics:
            line = (
                f"model: {metrics['params/total']:,.0f} parameters, "
                f"{metrics.get('params/non_embedding', 0.0):,.0f} outside the embedding"
            )
        else:
            line = format_line(step, self.max_steps, metrics)
        self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Remove the bar."""
        self.progress.stop()
