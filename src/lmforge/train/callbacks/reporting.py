"""Where a step's metrics go: the monitors (metrics.jsonl, W&B, the console) and this rank's log file.

Every step moves the console's progress bar; a step is logged every `log.interval` steps, at the first and the
last step, and whenever it validated or checkpointed, so those values are never dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.checkpoint.layout import CHECKPOINTS
from lmforge.config.train import TrainConfig
from lmforge.model.attention import describe_backend
from lmforge.monitor import ConsoleMonitor, JsonlMonitor, Monitors
from lmforge.monitor.console import format_line
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


def build_monitors(config: TrainConfig, is_main: bool, console: bool, start_step: int) -> Monitors:
    """Rank 0's monitors: metrics.jsonl always, W&B when `[wandb]` enables it, the console unless `console` is
    off. Other ranks log nothing (their facts go to their log files)."""
    monitors = Monitors([])
    if not is_main:
        return monitors
    run_dir = Path(config.output_dir)
    monitors.monitors.append(JsonlMonitor(run_dir / "metrics.jsonl"))
    if config.wandb.enabled:
        from lmforge.monitor.wandb import WandbMonitor

        config_json = config.model_dump(mode="json", by_alias=True)
        monitors.monitors.append(WandbMonitor(config.wandb, run_dir, config_json, start_step))
    if console:
        monitors.monitors.append(ConsoleMonitor(config.max_steps, start_step))
    return monitors


def console_of(monitors: Monitors) -> ConsoleMonitor | None:
    """The console monitor among `monitors`, if there is one."""
    return next((m for m in monitors.monitors if isinstance(m, ConsoleMonitor)), None)


class Reporting(Callback):
    """Sends each step's metrics to the trainer's monitors and log file; announces a stop. Runs after every other
    callback, so it sees the metrics they added."""

    def __init__(self, config: TrainConfig) -> None:
        """`log.interval` and `max_steps` decide which steps are logged."""
        self.interval = config.log.interval
        self.max_steps = config.max_steps

    def on_train_start(self, trainer: Trainer) -> None:
        """A fresh run logs step 0: the parameter counts and the data's own figures; the attention backend and the
        data's startup line are shown on the console (the log files have them too)."""
        if trainer.step == 0:
            trainer.record.write(0, {**trainer.params, **trainer.data_summary.metrics})
        self._print(trainer, f"attention {describe_backend(trainer.model.attn_backend, trainer.ctx.device)}")
        for line in trainer.data_summary.lines:
            trainer.log.info(line)
            self._print(trainer, line)

    def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Move the progress bar; log the step when it is due."""
        step = trainer.step
        console = console_of(trainer.monitors)
        if console is not None:
            console.update(step, metrics)
        marked = "time/val" in metrics or "time/save_ckpt" in metrics
        if marked or step % self.interval == 0 or step in (1, self.max_steps):
            trainer.record.write(step, metrics)
            trainer.log.info(format_line(step, self.max_steps, metrics))

    def on_train_end(self, trainer: Trainer) -> None:
        """After a stop request, tell the user where the checkpoint is and how to continue."""
        if trainer.stopped_by is None:
            return
        trainer.log.info("stopped after step %d (%s)", trainer.step, trainer.stopped_by)
        where = trainer.run_dir / CHECKPOINTS / f"step_{trainer.step}"
        self._print(
            trainer,
            f"lmforge: stopped after step {trainer.step} ({trainer.stopped_by}); checkpoint {where}. "
            "Continue with the same command plus --resume.step latest",
            plain_fallback=True,
        )

    @staticmethod
    def _print(trainer: Trainer, line: str, plain_fallback: bool = False) -> None:
        if not trainer.ctx.is_main:
            return
        console = console_of(trainer.monitors)
        if console is not None:
            console.console.print(line, highlight=False, soft_wrap=True)
        elif plain_fallback:
            print(line, flush=True)
