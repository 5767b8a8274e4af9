"""The one training loop: setup, then one optimizer step at a time, then hooks and monitors.

Every data type and init goes through here; features that only some runs need are step hooks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lmforge.config.loader import ConfigError, dump_toml
from lmforge.config.train import TrainConfig
from lmforge.data import TokenizerInfo, build_step_data, load_tokenizer
from lmforge.data.batch import MicroBatch
from lmforge.data.prefetch import Prefetcher
from lmforge.data.tokens import TokenData
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.monitor import ConsoleMonitor, JsonlMonitor, Monitors
from lmforge.optim import build_optimizer, set_lr_multiplier, wsd_multiplier
from lmforge.train.hooks import StepHook
from lmforge.train.metrics import peak_memory_gib, perplexity, reduce_step_stats
from lmforge.train.micro_batches import rerun_without_nonfinite, run_micro_batches
from lmforge.train.parallel import DistContext, parallelize

VOCAB_MULTIPLE = 128


def padded_vocab_size(n: int) -> int:
    """The model's vocabulary: n token ids rounded up to a multiple of 128 (faster matmuls, shardable)."""
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_vocab_size(config: TrainConfig, tokenizer: TokenizerInfo | None) -> int:
    """The model's vocabulary: the tokenizer's length (or fake data's id range), rounded up to 128."""
    if tokenizer is not None:
        if config.data.type == "fake" and config.data.vocab_size > tokenizer.size:
            raise ConfigError(
                f"data.vocab_size ({config.data.vocab_size}) exceeds the tokenizer's {tokenizer.size} ids"
            )
        return padded_vocab_size(tokenizer.size)
    assert config.data.type == "fake", "token data requires a tokenizer (checked with the config)"
    return padded_vocab_size(config.data.vocab_size)


def prepare_output_dir(config: TrainConfig, overwrite: bool) -> Path:
    """Create the run directory and write the resolved config; refuse to mix two runs' metrics."""
    out = Path(config.output_dir)
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        if not overwrite:
            raise ConfigError(
                f"output_dir {out} already holds a run ({metrics} exists); choose another --output-dir "
                "or pass --overwrite to start over"
            )
        metrics.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(config), encoding="utf-8")
    return out


class Trainer:
    """Owns the model, optimizer, data stream and monitors of one rank."""

    def __init__(
        self, config: TrainConfig, ctx: DistContext, hooks: Sequence[StepHook] = (), console: bool = True
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.hooks = list(hooks)
        self.step = 0
        self.tokens_seen = 0
        self.tokenizer = load_tokenizer(config.tokenizer.name) if config.tokenizer.name else None
        source = build_step_data(config.data, ctx.rank, ctx.world_size, self.tokenizer)
        if isinstance(source, TokenData):
            source.check_budget(config.max_steps)
        vocab = model_vocab_size(config, self.tokenizer)
        model = build_model(config.model.arch, vocab, config.model.attn, ctx.device)
        init_weights(model, config.model.init.std, config.model.init.seed)
        self.model = parallelize(model, model.blocks, config.model, ctx)
        self.optimizer = build_optimizer(self.model, config.optim, ctx.device)
        self.data = Prefetcher(source, pin_memory=ctx.device.type == "cuda")
        self.monitors = Monitors([])
        self.console: ConsoleMonitor | None = None
        if ctx.is_main:
            self.monitors.monitors.append(JsonlMonitor(Path(config.output_dir) / "metrics.jsonl"))
            if console:
                self.console = ConsoleMonitor(config.max_steps, self.step)
                self.monitors.monitors.append(self.console)

    def _clip(self) -> torch.Tensor:
        max_norm = self.config.optim.max_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def train_step(self, micro_batches: list[MicroBatch], data_wait: float) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's global metrics."""
        device, defer = self.ctx.device, self.config.model.defer_grad_sync
        stats = run_micro_batches(self.model, micro_batches, device, defer)
        grad_norm = self._clip()
        wait = torch.tensor(data_wait, device=device)
        sums, maxes = reduce_step_stats(
            {
                "loss_sum": stats.loss_sum,
                "loss_tokens": stats.loss_tokens,
                "tokens": stats.tokens,
                "nan_count": stats.nan_count,
                "data_wait": wait,
            },
            {
                "grad_norm": grad_norm,
                "data_wait": wait,
                "peak_memory": torch.tensor(peak_memory_gib(device), device=device),
            },
        )
        if sums["nan_count"] > 0:
            # Rare: redo the step without the bad micro-batches (on every rank, so FSDP collectives match).
            rerun_without_nonfinite(self.model, micro_batches, stats.finite.tolist(), device, defer)
            maxes["grad_norm"] = float(self._clip())
        multiplier = wsd_multiplier(self.step + 1, self.config.max_steps, self.config.schedule)
        set_lr_multiplier(self.optimizer, multiplier)
        skipped = not math.isfinite(maxes["grad_norm"]) or sums["loss_tokens"] == 0
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += int(sums["tokens"])
        loss = sums["loss_sum"] / sums["loss_tokens"] if sums["loss_tokens"] else math.nan
        return {
            "loss/mean": loss,
            "loss/perplexity": perplexity(loss) if math.isfinite(loss) else math.nan,
            "loss/nan_count": sums["nan_count"],
            "optim/lr": self.config.optim.lr * multiplier,
            "optim/grad_norm": maxes["grad_norm"],
            "optim/skipped": float(skipped),
            "time/data/max": maxes["data_wait"],
            "time/data/mean": sums["data_wait"] / self.ctx.world_size,
            "progress/num_tokens": float(self.tokens_seen),
            "progress/epoch": self.data.epoch,
            "perf/peak_memory": maxes["peak_memory"],
            "batch/tokens": sums["tokens"],
        }

    def train(self) -> None:
        """Run steps until max_steps, then the end-of-training hooks."""
        cfg = self.config
        last = time.perf_counter()
        try:
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                micro_batches = self.data.next_step()
                metrics = self.train_step(micro_batches, time.perf_counter() - t0)
                now = time.perf_counter()
                metrics["time/step"] = now - last
                metrics["perf/throughput"] = metrics.pop("batch/tokens") / metrics["time/step"]
                last = now
                for hook in self.hooks:
                    if hasattr(hook, "after_optimizer_step"):
                        hook.after_optimizer_step(self, self.step, metrics)
                if self.console is not None:
                    self.console.update(self.step, metrics)
                if self.step % cfg.log.interval == 0 or self.step == cfg.max_steps or self.step == 1:
                    self.monitors.log(self.step, metrics)
            for hook in self.hooks:
                if hasattr(hook, "on_train_end"):
                    hook.on_train_end(self)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the data worker and close the monitors."""
        self.data.close()
        self.monitors.close()
