"""The one training loop: setup, then one optimizer step at a time, then hooks and monitors.

Every data type and init goes through here; features that only some runs need are step hooks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmforge.config.ckpt import CkptConfig
from lmforge.config.train import TrainConfig
from lmforge.data import build_step_data, load_tokenizer
from lmforge.data.batch import MicroBatch
from lmforge.data.prefetch import Prefetcher
from lmforge.data.sft import SFTData, describe
from lmforge.data.tokens import TokenData
from lmforge.model import build_model
from lmforge.model.completep import role_scales
from lmforge.model.init import init_weights
from lmforge.model.roles import param_role
from lmforge.monitor import ConsoleMonitor, JsonlMonitor, Monitors
from lmforge.monitor.console import format_line
from lmforge.optim import build_optimizer, clip_gradients, group_grad_squares, set_lr_multiplier, wsd_multiplier
from lmforge.train.balance import MoEBalancer
from lmforge.train.checkpoint import (
    CHECKPOINTS,
    MODEL_FILES,
    Checkpointer,
    load_checkpoint,
)
from lmforge.train.flops import FlopCounter, attended_pairs, param_counts, peak_flops
from lmforge.train.health import SpikeDetector
from lmforge.train.hooks import StepHook
from lmforge.train.logs import close_logger, rank_logger
from lmforge.train.metrics import peak_memory_gib, perplexity, reduce_step_stats
from lmforge.train.micro_batches import rerun_without_nonfinite, run_micro_batches
from lmforge.train.parallel import DistContext, parallelize
from lmforge.train.preemption import StopRequest
from lmforge.train.setup import model_vocab_size


class Trainer:
    """Owns the model, optimizer, data stream and monitors of one rank."""

    def __init__(
        self,
        config: TrainConfig,
        ctx: DistContext,
        hooks: Sequence[StepHook] = (),
        console: bool = True,
        resume_from: Path | None = None,
    ) -> None:
        """Build everything of this rank; `resume_from` is a checkpoint folder (see `prepare_output_dir`)."""
        self.config = config
        self.ctx = ctx
        self.hooks = list(hooks)
        self.step = 0
        self.tokens_seen = 0
        self.schedule_start = 0
        self.stopped_by: str | None = None
        self.stop_agreed = False
        self.run_dir = Path(config.output_dir)
        self.tokenizer = load_tokenizer(config.tokenizer.name) if config.tokenizer.name else None
        source = build_step_data(config.data, ctx.rank, ctx.world_size, self.tokenizer)
        vocab = model_vocab_size(config, self.tokenizer)
        arch = config.model.arch
        assert arch is not None, "model.arch is filled in from model.name when the config is loaded"
        model = build_model(arch, vocab, config.model.attn, ctx.device, meta=True)
        model.loss_chunk_tokens = config.model.loss_chunk_tokens
        self.model = parallelize(model, model.blocks, config.model, ctx)
        init = config.model.init
        scale = role_scales(arch, init.scheme, init.base_hidden_size, init.base_num_layers)
        if resume_from is None:
            if config.model.name is None or config.model.debug.random_init:
                stds = {n: scale(param_role(n, p.ndim)).init_std for n, p in self.model.named_parameters()}
                init_weights(self.model, init.std, init.seed, init.truncate, stds)
            else:
                from lmforge.model.hf_weights import load_hf_weights

                load_hf_weights(self.model, Path(config.model.name))
        self.balancer: MoEBalancer | None = None
        if self.model.moe_layers():
            coeff = getattr(arch, "load_balance_coeff", None)
            self.balancer = MoEBalancer(self.model, config.model.moe_balance, coeff, config.max_steps)
        self.optimizer = build_optimizer(self.model, config.optim, ctx.device, scale)
        state: dict[str, Any] = {}
        if resume_from is not None:
            skip = config.resume
            state = load_checkpoint(resume_from, self.model, None if skip.skip_optimizer else self.optimizer, ctx.rank)
            self.step = self.schedule_start = int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
            if not skip.skip_scheduler:
                self.schedule_start = int(state["schedule_start"])
            if skip.skip_data:
                state.pop("data")
        if isinstance(source, TokenData):
            source.check_budget(config.max_steps - (self.step if "data" not in state else 0))
        self.data = Prefetcher(source, pin_memory=ctx.device.type == "cuda")
        if "data" in state:
            self.data.load_state_dict(state["data"])
        self.data_stats: dict[str, float] = {}
        if isinstance(source, SFTData):
            source.check_budget(config.max_steps, self.step)
            stats = source.samples.stats
            self.data_stats = {"data/samples": float(len(source.samples)), "data/overlong": float(stats.overlong),
                               "data/no_loss_skipped": float(stats.no_loss)}  # fmt: skip
            self.data_line = f"data: {describe(stats, len(source.samples))}"
        if ctx.is_main:
            from lmforge.hf_folder import write_model_files

            write_model_files(self.run_dir / MODEL_FILES, arch, vocab, self.tokenizer, init_std=config.model.init.std)
        self.checkpointer = Checkpointer(
            self.run_dir,
            config.ckpt,
            ctx,
            {"config.toml": self.run_dir / "config.toml", MODEL_FILES: self.run_dir / MODEL_FILES},
        )
        self.snapshots: Checkpointer | None = None
        if config.eval_snapshots.interval is not None:
            # Written in the background on a gloo group of their own, like async checkpoints.
            snapshot_cfg = CkptConfig(async_save=True)
            self.snapshots = Checkpointer(self.run_dir, snapshot_cfg, ctx, {}, model_only=True)
        self.flops = FlopCounter(self.model, arch.num_hidden_layers, arch.num_attention_heads, arch.dim_per_head)
        self.peak_flops = peak_flops(ctx.device)
        self.params = param_counts(self.model)
        log = config.log
        self.loss_spikes = SpikeDetector(log.loss_spike_factor, log.spike_window)
        self.grad_spikes = SpikeDetector(log.grad_spike_factor, log.spike_window)
        self.log = rank_logger(self.run_dir, ctx.rank)
        self.log.info(
            "rank %d of %d on %s: %s, %s parameters, attention %s, %s",
            ctx.rank, ctx.world_size, ctx.device, arch.model_type, f"{self.params['params/total']:,.0f}",
            model.attn_backend, f"resumed from {resume_from}" if resume_from else "from scratch",
        )  # fmt: skip
        if config.val.sets or config.val.data:
            from lmforge.train.validation import Validator

            self.hooks.append(Validator(config.val, config.data, self.tokenizer, ctx.rank, ctx.world_size))
        self.monitors = Monitors([])
        self.console: ConsoleMonitor | None = None
        if ctx.is_main:
            self.monitors.monitors.append(JsonlMonitor(Path(config.output_dir) / "metrics.jsonl"))
            if config.wandb.enabled:
                from lmforge.monitor.wandb import WandbMonitor

                config_json = config.model_dump(mode="json", by_alias=True)
                self.monitors.monitors.append(WandbMonitor(config.wandb, self.run_dir, config_json, self.step))
            if console:
                self.console = ConsoleMonitor(config.max_steps, self.step)
                self.monitors.monitors.append(self.console)

    def train_step(self, micro_batches: list[MicroBatch], data_wait: float, stop: bool = False) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's global metrics. `stop` is this
        rank's stop request; `self.stop_agreed` says afterwards whether any rank made one."""
        device, defer = self.ctx.device, self.config.model.defer_grad_sync
        if self.balancer is not None:
            self.balancer.start_step(micro_batches)
        stats = run_micro_batches(self.model, micro_batches, device, defer)
        wait = torch.tensor(data_wait, device=device)
        squares = group_grad_squares(self.optimizer, device)
        sums, maxes = reduce_step_stats(
            {
                "loss_sum": stats.loss_sum,
                "loss_tokens": stats.loss_tokens,
                "tokens": stats.tokens,
                "nan_count": stats.nan_count,
                "data_wait": wait,
                "pairs": torch.tensor(float(attended_pairs(mb["seq_lens"] for mb in micro_batches)), device=device),
                "peak_memory": torch.tensor(peak_memory_gib(device), device=device),
                **{f"grad_sq/{name}": sq for name, sq in squares.items()},
                **(self.balancer.device_stats() if self.balancer is not None else {}),
            },
            {
                "data_wait": wait,
                "peak_memory": torch.tensor(peak_memory_gib(device), device=device),
                "stop": torch.tensor(float(stop), device=device),
            },
        )
        self.stop_agreed = maxes["stop"] > 0
        routing: dict[str, float] = {}
        if self.balancer is not None:
            moe = {k: sums.pop(k) for k in ("moe/counts", "moe/confidence", "moe/seq_aux")}
            routing = self.balancer.update(self.step + 1, moe["moe/counts"], moe["moe/confidence"], moe["moe/seq_aux"])
        if sums["nan_count"] > 0:
            # Rare: redo the step without the bad micro-batches (on every rank, so FSDP collectives match).
            rerun_without_nonfinite(self.model, micro_batches, stats.finite.tolist(), device, defer)
            again, _ = reduce_step_stats(
                {f"grad_sq/{name}": sq for name, sq in group_grad_squares(self.optimizer, device).items()}, {}
            )
            sums.update(again)
        group_sq = {name: sums[f"grad_sq/{name}"] for name in squares}
        grad_norm = math.sqrt(sum(group_sq.values()))
        clip_gradients(self.optimizer, grad_norm, self.config.optim.max_norm)
        multiplier = wsd_multiplier(
            self.step + 1 - self.schedule_start, self.config.max_steps - self.schedule_start, self.config.schedule
        )
        set_lr_multiplier(self.optimizer, multiplier)
        skipped = not math.isfinite(grad_norm) or sums["loss_tokens"] == 0
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += int(sums["tokens"])
        loss = sums["loss_sum"] / sums["loss_tokens"] if sums["loss_tokens"] else math.nan
        metrics = {
            "loss/mean": loss,
            "loss/perplexity": perplexity(loss) if math.isfinite(loss) else math.nan,
            "loss/nan_count": sums["nan_count"],
            "loss/tokens": sums["loss_tokens"],
            "loss/spike": float(self.loss_spikes.update(loss)),
            "optim/lr": self.config.optim.lr * multiplier,
            "optim/grad_norm": grad_norm,
            "optim/grad_norm_spike": float(self.grad_spikes.update(grad_norm)),
            "optim/skipped": float(skipped),
            "time/data/max": maxes["data_wait"],
            "time/data/mean": sums["data_wait"] / self.ctx.world_size,
            "progress/num_tokens": float(self.tokens_seen),
            "progress/epoch": self.data.epoch,
            "perf/peak_memory": maxes["peak_memory"],
            "perf/peak_memory_mean": sums["peak_memory"] / self.ctx.world_size,
            "batch/tokens": sums["tokens"],
            "batch/pairs": sums["pairs"],
            **routing,
        }
        for group in self.optimizer.param_groups:
            metrics[f"optim/grad_norm/{group['name']}"] = math.sqrt(group_sq[group["name"]])
            metrics[f"optim/lr/{group['name']}"] = group["lr"]
        return metrics

    def save_checkpoint(self) -> float:
        """Checkpoint the current step (every rank); returns the seconds the step loop was blocked."""
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "schedule_start": self.schedule_start,
            "data": self.data.state_dict(),
        }
        return self.checkpointer.save(self.step, self.model, self.optimizer, state)

    def _checkpoint_due(self) -> bool:
        ckpt, step = self.config.ckpt, self.step
        if step == self.config.max_steps and ckpt.final:
            return True
        return ckpt.interval is not None and step % ckpt.interval == 0

    def train(self) -> None:
        """Run steps until max_steps (or a stop signal), then the end-of-training hooks."""
        cfg = self.config
        stop = StopRequest()
        stop.install()
        if self.step == 0:
            self.monitors.log(0, {**self.params, **self.data_stats})
        if self.data_stats:
            self.log.info(self.data_line)
            if self.console is not None:
                self.console.console.print(self.data_line, highlight=False, soft_wrap=True)
        last = time.perf_counter()
        try:
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                micro_batches = self.data.next_step()
                metrics = self.train_step(micro_batches, time.perf_counter() - t0, stop.requested)
                now = time.perf_counter()
                metrics["time/step"] = now - last
                self._add_throughput(metrics)
                saved = self._checkpoint_due() or self.stop_agreed
                if saved:
                    metrics["time/save_ckpt"] = self.save_checkpoint()
                    self.log.info("checkpoint of step %d (loop blocked %.3f s)", self.step, metrics["time/save_ckpt"])
                else:
                    self.checkpointer.poll()
                if self.snapshots is not None:
                    every = cfg.eval_snapshots.interval
                    if self.step % every == 0 or self.step == cfg.max_steps:  # type: ignore[operator]
                        metrics["time/save_snapshot"] = self.snapshots.save(self.step, self.model, None, {})
                    else:
                        self.snapshots.poll()
                for hook in self.hooks:
                    if hasattr(hook, "after_optimizer_step"):
                        hook.after_optimizer_step(self, self.step, metrics)
                if self.console is not None:
                    self.console.update(self.step, metrics)
                validated = "time/val" in metrics
                if validated or saved or self.step % cfg.log.interval == 0 or self.step in (1, cfg.max_steps):
                    self.monitors.log(self.step, metrics)
                    self.log.info(format_line(self.step, cfg.max_steps, metrics))
                last = time.perf_counter()  # a checkpoint's time is time/save_ckpt, not the next step's time/step
                if self.stop_agreed:
                    self.stopped_by = stop.signal_name or "a stop signal on another rank"
                    break
            self.checkpointer.close()
            if self.snapshots is not None:
                self.snapshots.close()
            if self.stopped_by is not None:
                self._announce_stop()
                return
            for hook in self.hooks:
                if hasattr(hook, "on_train_end"):
                    hook.on_train_end(self)
        except BaseException:
            self.log.exception("training stopped by an exception at step %d", self.step)
            raise
        finally:
            stop.uninstall()
            self.close()

    def _add_throughput(self, metrics: dict[str, float]) -> None:
        seconds, ws = metrics["time/step"], self.ctx.world_size
        tokens, pairs = metrics.pop("batch/tokens"), metrics.pop("batch/pairs")
        metrics["perf/throughput"] = tokens / seconds
        metrics["perf/throughput_per_device"] = tokens / seconds / ws
        if self.peak_flops is not None:
            flops, dense = self.flops.step_flops(tokens, pairs)
            metrics["perf/mfu"] = flops / (seconds * self.peak_flops * ws)
            metrics["perf/mfu_6nd"] = dense / (seconds * self.peak_flops * ws)

    def _announce_stop(self) -> None:
        self.log.info("stopped after step %d (%s)", self.step, self.stopped_by)
        if self.ctx.is_main:
            where = self.run_dir / CHECKPOINTS
            message = (
                f"lmforge: stopped after step {self.step} ({self.stopped_by}); checkpoint {where}/step_{self.step}. "
                f"Continue with the same command plus --resume.step latest"
            )
            if self.console is not None:
                self.console.console.print(message, highlight=False)
            else:
                print(message, flush=True)

    def close(self) -> None:
        """Stop the data worker, close the monitors and the log file."""
        self.data.close()
        self.monitors.close()
        close_logger(self.log)
