"""`lmforge eval RUN_DIR`: score a training run's model-only snapshots on its `[val]` sets, beside the training.

The trainer writes `<run>/snapshots/step_N/` every `eval_snapshots.interval` steps and at the last step (renamed
into place once complete). The worker, on its own processes (plain or under torchrun, on other GPUs), builds the
model and the validation sets once from the run's `config.toml`, then repeatedly takes the oldest complete
snapshot, loads it into the model, runs one validation round, logs the metrics at the snapshot's step to
`<run>/metrics.jsonl` and, when the run's config has `[wandb]`, to a W&B run of its own beside the training's
(`<name>-eval`, see `lmforge.monitor.wandb`), marks the snapshot scored and deletes it. It stops after the
snapshot of the run's last step.
A worker killed and started again continues with the snapshots still there; one killed after logging but before
deleting finds the mark and deletes the snapshot without scoring it again.

`score_model` is the one-off form (`lmforge eval --model FOLDER --config CONFIG`): one validation round of a
model folder (an HF export, or any Llama-family folder lmforge loads) on a training config's `[val]` sets, scored
exactly as training scores them.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from lmforge.checkpoint.layout import list_checkpoints

if TYPE_CHECKING:
    import torch

    from lmforge.config.train import TrainConfig
    from lmforge.eval.validation import Validator
    from lmforge.parallel.process_group import DistContext

SCORED = "SCORED"
"""Marker file inside a snapshot whose metrics are logged."""


def pending_snapshots(root: Path) -> list[int]:
    """Steps of the complete snapshots under `root`, oldest first."""
    return list_checkpoints(root) if root.is_dir() else []


def read_run_config(run: Path) -> TrainConfig:
    """The resolved config a training run wrote into `run/config.toml`; a `ConfigError` names what is wrong."""
    from lmforge.config import ConfigError
    from lmforge.config.loader import compose, validate
    from lmforge.config.train import TrainConfig

    path = run / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{run} is not a run directory: {path} is missing")
    raw = compose(["@", str(path)])
    config = validate(TrainConfig, raw)
    assert isinstance(config, TrainConfig)
    return config


def run_worker(run: Path, config: TrainConfig, poll_seconds: float = 10.0, latest_only: bool = False,
               limit: int | None = None) -> None:  # fmt: skip
    """Score `run`'s snapshots as they appear (see the module docstring) on this process's rank: the oldest first,
    or with `latest_only` the newest (deleting the older ones); stop after the run's last step or `limit` scores."""
    import torch.distributed as dist

    from lmforge.checkpoint.layout import SNAPSHOTS, step_name
    from lmforge.checkpoint.load import load_model_state
    from lmforge.monitor import JsonlMonitor, Monitors
    from lmforge.monitor.wandb import WandbMonitor
    from lmforge.parallel.process_group import shutdown_distributed

    ctx = _scoring_context(config)
    console = Console()
    try:
        model, validator = _scoring_model(config, ctx)
        monitor = None
        if ctx.is_main:
            monitor = Monitors([JsonlMonitor(run / "metrics.jsonl")])
            if config.wandb.enabled:
                dumped = config.model_dump(mode="json", by_alias=True)
                monitor.monitors.append(WandbMonitor(config.wandb, run, dumped, job="eval"))
        root, scored = run / SNAPSHOTS, 0
        while limit is None or scored < limit:
            steps = pending_snapshots(root)
            if ctx.world_size > 1:  # every rank takes the same snapshot
                shared = [steps]
                dist.broadcast_object_list(shared, src=0)
                steps = shared[0]
            if not steps:
                time.sleep(poll_seconds)
                continue
            step = steps[-1] if latest_only else steps[0]
            folder = root / step_name(step)
            if not (folder / SCORED).exists():
                load_model_state(folder, model)
                metrics = validator.evaluate(model, ctx.device, validator.arrays_dir(run, step))
                if monitor is not None:
                    monitor.log(step, metrics)
                    (folder / SCORED).touch()
                    console.print(f"eval: step {step} scored ({metrics['time/val']:.1f} s)", highlight=False)
                scored += 1
            if ctx.world_size > 1:
                dist.barrier()  # every rank is done reading before the files go
            if ctx.is_main:
                for s in steps if latest_only else [step]:
                    if s <= step:
                        shutil.rmtree(root / step_name(s), ignore_errors=True)
            if step >= config.max_steps:
                break
        if monitor is not None:
            monitor.close()
    finally:
        shutdown_distributed()


def score_model(config: TrainConfig) -> dict[str, float]:
    """One validation round of the model `config.model.name` names (an HF folder) on `config`'s `[val]` sets, on
    this process's rank (plain or under torchrun: rows are dealt over the ranks and the sums all-reduced). The
    model is built as training builds it from that folder, so the figures are those the same weights would get as a
    training run's `val/*` metrics."""
    from lmforge.hf.weights import load_hf_weights
    from lmforge.parallel.process_group import shutdown_distributed

    assert config.model.name is not None, "score_model needs model.name"
    ctx = _scoring_context(config)
    try:
        model, validator = _scoring_model(config, ctx)
        load_hf_weights(model, Path(config.model.name))
        return validator.evaluate(model, ctx.device)
    finally:
        shutdown_distributed()


def _scoring_context(config: TrainConfig) -> DistContext:
    """This process's ranks, with the run's context, expert and tensor parallelism where this world size allows them
    (the numbers are the same without)."""
    from lmforge.launch.torchrun import env_world_size
    from lmforge.parallel.process_group import init_distributed

    world = env_world_size()
    cp, ep, tp = (degree if world % degree == 0 else 1 for degree in (config.parallel.cp, config.parallel.ep,
                                                                      config.parallel.tp))  # fmt: skip
    tp = tp if world % (cp * tp) == 0 else 1
    return init_distributed(cp=cp, ep=ep, tp=tp)


def _scoring_model(config: TrainConfig, ctx: DistContext) -> tuple[torch.nn.Module, Validator]:
    """The run's model (storage unfilled: the caller loads the weights) and its `[val]` sets, for this rank."""
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.eval.validation import Validator
    from lmforge.parallel.model_setup import build_run_model

    tokenizer = load_tokenizer(config.tokenizer.name) if config.tokenizer.name else None
    model = build_run_model(config, tokenizer, ctx)
    return model, Validator(config.val, config.data, tokenizer, ctx.dp_rank, ctx.dp_size, ctx.cp, ctx.counts_tokens)
