"""The one training loop. Every data type and init goes through it:

    for each step:  micro-batches -> forward/backward -> one reduction -> clip, schedule and update -> metrics

A `Trainer` is made of typed parts (model, optimizers, data stream, monitors) and a list of callbacks, the
optional features that only some runs use (`lmforge.train.callbacks`), called in the order that
`lmforge.train.callbacks.order` declares.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmforge.checkpoint.layout import MODEL_FILES
from lmforge.checkpoint.load import load_checkpoint
from lmforge.config.train import TrainConfig
from lmforge.data.batch import MicroBatch
from lmforge.data.prefetch import Prefetcher
from lmforge.data.stream import DataSummary, build_step_data, open_stream, summarize
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.data.tokens import TokenData
from lmforge.eval.validation import Validator
from lmforge.hf.folder import write_model_files
from lmforge.model import build_model
from lmforge.model.attention import describe_backend
from lmforge.model.completep import role_scales
from lmforge.model.fp8 import describe_fp8, precompute_fp8_scales, uses_fp8_all_gather
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.model.roles import param_role
from lmforge.monitor import Monitors
from lmforge.optim import Optimizers, OptimizerStep, build_optimizer
from lmforge.optim.optimizers import group_base_lrs
from lmforge.parallel.context import shard_micro_batch
from lmforge.parallel.model_setup import build_pipelined_model, build_run_model
from lmforge.parallel.pipeline import Pipeline, PipelineScorer
from lmforge.parallel.process_group import DistContext
from lmforge.train.callbacks.balancing import MoEBalancer, moe_balancer
from lmforge.train.callbacks.base import Callback
from lmforge.train.callbacks.batch_hashes import BatchHashes
from lmforge.train.callbacks.checkpointing import Checkpointing
from lmforge.train.callbacks.eval_snapshots import EvalSnapshots
from lmforge.train.callbacks.mtp import MtpLoss
from lmforge.train.callbacks.order import in_order
from lmforge.train.callbacks.reporting import Reporting, build_monitors
from lmforge.train.callbacks.source_shares import SourceShares
from lmforge.train.callbacks.spike_flags import SpikeFlags
from lmforge.train.callbacks.validation import Validation
from lmforge.train.flops import FlopCounter, param_counts, peak_flops
from lmforge.train.host_memory import retain_freed_memory
from lmforge.train.logs import close_logger, rank_logger
from lmforge.train.metrics import peak_memory_gib, perplexity, reduce_step_stats
from lmforge.train.micro_batches import (
    MicroBatchStats,
    agreed_finite,
    rerun_without_nonfinite,
    run_micro_batches,
    run_pipelined,
)
from lmforge.train.preemption import StopRequest
from lmforge.train.record import RunRecord


class Trainer:
    """One rank's share of a run: its parts, its callbacks, and the step loop."""

    config: TrainConfig
    """The resolved config."""
    ctx: DistContext
    """Rank, world size, device and mesh of this process."""
    run_dir: Path
    """`config.output_dir`."""
    tokenizer: TokenizerInfo | None
    """The run's tokenizer (None only for fake data without one)."""
    model: CausalLM
    """The model, sharded or moved for this rank."""
    optimizer: Optimizers
    """Every optimizer with the schedule and clipping."""
    data: Prefetcher
    """This rank's micro-batches, prepared ahead."""
    data_summary: DataSummary
    """The data's startup figures (step 0 metrics and a console line)."""
    params: dict[str, float]
    """`params/*`: parameter counts, logged at step 0."""
    flops: FlopCounter
    """Training FLOPs of a step, for MFU."""
    peak_flops: float | None
    """Peak FLOP/s of the device (None on CPU: no MFU)."""
    monitors: Monitors
    """Where logged metrics go (rank 0; empty elsewhere)."""
    log: logging.Logger
    """This rank's log file."""
    callbacks: list[Callback]
    """Optional features, in the order `lmforge.train.callbacks.order.ORDER` declares (the loop calls them so)."""
    step: int
    """Optimizer steps taken (including those before a resume)."""
    tokens_seen: int
    """Tokens trained on over all ranks (including before a resume)."""
    stop_agreed: bool
    """Whether some rank asked to stop at the last step (known to every rank through the step's reduction)."""
    stopped_by: str | None
    """What ended the loop early (a signal name), None otherwise."""
    fp8_all_gather: bool
    """Whether FSDP all-gathers float8 weights, whose scales are precomputed after each optimizer step."""
    record: RunRecord
    """The run's record on this rank (its monitors and log file); a failed write stops every rank at the next step
    (`lmforge.train.record`)."""

    def __init__(
        self,
        config: TrainConfig,
        ctx: DistContext,
        callbacks: Sequence[Callback] = (),
        console: bool = True,
        resume_from: Path | None = None,
    ) -> None:
        """Build every part of this rank; `callbacks` run after the configured ones, before reporting (`EXTRA` in
        `lmforge.train.callbacks.order`).
        `resume_from` is a checkpoint folder (see `lmforge.checkpoint.run_dir.prepare_run`)."""
        self.config, self.ctx = config, ctx
        # On the CPU, reusing freed activation memory saves the page faults of fresh buffers every step.
        kept = retain_freed_memory() if ctx.device.type == "cpu" else False
        self.run_dir = Path(config.output_dir)
        self.step = self.tokens_seen = 0
        self.stop_agreed, self.stopped_by = False, None
        self.tokenizer = load_tokenizer(config.tokenizer.name) if config.tokenizer.name else None
        # Every rank of a context-parallel group trains on the same rows: they are dealt per data-parallel rank.
        source = build_step_data(config.data, ctx.dp_rank, ctx.dp_size, self.tokenizer)
        self.pipeline: Pipeline | None = None
        """This rank's pipeline stages and schedule under pipeline parallelism (`parallel.pp` > 1)."""
        if ctx.pp.size > 1:
            self.model, self.pipeline = build_pipelined_model(config, self.tokenizer, ctx)
        else:
            self.model = build_run_model(config, self.tokenizer, ctx)
        self.model.z_loss = config.model.z_loss
        arch = config.model.arch
        assert arch is not None, "model.arch is filled in from model.name when the config is loaded"
        init = config.model.init
        scale = role_scales(arch, init.scheme, init.base_hidden_size, init.base_num_layers)
        if resume_from is None:
            self._initialize_weights(scale)
        # The whole model's figures (parameter counts, FLOPs, every optimizer group and MoE block): under pipeline
        # parallelism this rank holds some stages only.
        whole = (
            self.model
            if self.pipeline is None
            else build_model(arch, self.model.vocab_size, config.model.attn, ctx.device, meta=True)
        )
        balancer = moe_balancer(self.model, config.model.moe_balance, config.max_steps, ctx.counts_rows, whole, ctx.pp)
        self.optimizer = build_optimizer(self.model, config.optim, scale, config.schedule, config.max_steps)
        self.group_lrs = group_base_lrs(whole, config.optim, scale)
        """Every optimizer group's peak learning rate, held on this rank or not."""
        state = self._resume(resume_from) if resume_from is not None else {}
        self.data = open_stream(source, config.max_steps, self.step, state.get("data"), ctx.device.type == "cuda")
        self.data_summary = summarize(source)
        if ctx.is_main:
            vocab = self.model.vocab_size
            write_model_files(self.run_dir / MODEL_FILES, arch, vocab, self.tokenizer, init_std=config.model.init.std)
        configured = self._configured_callbacks(balancer)
        if isinstance(source, TokenData) and source.sources is not None:
            configured.append(SourceShares(source.sources.names))
        if config.log.batch_hashes:
            configured.append(BatchHashes())
        windows = [arch.attention_window(i) for i in range(arch.num_hidden_layers)]
        self.flops = FlopCounter(whole, arch.num_hidden_layers, arch.num_attention_heads, arch.dim_per_head,
                                 windows, arch.value_head_dim)  # fmt: skip
        self.peak_flops = peak_flops(ctx.device)
        self.params = param_counts(whole)
        self.log = rank_logger(self.run_dir, ctx.rank)
        self.fp8_all_gather = uses_fp8_all_gather(self.model)
        fp8 = describe_fp8(self.model)
        chunk = self.model.loss_chunk_tokens
        self.log.info(
            "rank %d of %d on %s: %s, %s parameters, attention %s, loss %s, %s%s%s",
            ctx.rank, ctx.world_size, ctx.device, arch.model_type, f"{self.params['params/total']:,.0f}",
            describe_backend(self.model.attn_backend, ctx.device),
            f"in chunks of {chunk} tokens" if chunk else "over the full logits",
            f"resumed from {resume_from}" if resume_from else "from scratch",
            f", {fp8}" if fp8 else "",
            ", freed host memory kept for reuse (glibc mallopt)" if kept else "",
        )  # fmt: skip
        if config.val.sets or config.val.data:
            validator = Validator(config.val, config.data, self.tokenizer, ctx.dp_rank, ctx.dp_size, ctx.cp,
                                  ctx.counts_tokens)  # fmt: skip
            configured.append(Validation(validator))
        self.callbacks = in_order([*configured, *callbacks, Reporting(config)])
        saved = state.get("callbacks", {})
        for cb in self.callbacks:
            if cb.name in saved:
                cb.load_state_dict(saved[cb.name])
        self.monitors = build_monitors(config, ctx.is_main, console, self.step)
        self.record = RunRecord(self.monitors, self.log, ctx, self.run_dir)

    @property
    def scorer(self) -> torch.nn.Module:
        """What validation calls to score rows: the model, or under pipeline parallelism a forward-only pass through
        its stages (`lmforge.parallel.pipeline.PipelineScorer`)."""
        return self.model if self.pipeline is None else PipelineScorer(self.pipeline, self.model)

    def _initialize_weights(self, scale: Any) -> None:
        config = self.config
        if config.model.name is None or config.model.debug.random_init:
            init = config.model.init
            stds = {n: scale(param_role(n, p.ndim)).init_std for n, p in self.model.named_parameters()}
            init_weights(self.model, init.std, init.seed, init.truncate, stds, zero_out_proj=init.zero_out_proj)
        else:
            from lmforge.hf.weights import load_hf_weights

            load_hf_weights(self.model, Path(config.model.name))

    def _resume(self, checkpoint: Path) -> dict[str, Any]:
        """Load the checkpoint into the model and optimizers; returns the trainer state (without `data` when the
        run restarts its data stream)."""
        skip = self.config.resume
        optimizer = None if skip.skip_optimizer else self.optimizer
        state = load_checkpoint(checkpoint, self.model, optimizer, self.ctx.rank)
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        # A skipped schedule state starts a new warmup and decay over the remaining steps.
        self.optimizer.load_schedule_state(state if not skip.skip_scheduler else {"schedule_start": self.step})
        if skip.skip_data:
            state.pop("data")
        return state

    def _configured_callbacks(self, balancer: MoEBalancer | None) -> list[Callback]:
        config, ctx = self.config, self.ctx
        callbacks: list[Callback] = [] if balancer is None else [balancer]
        if len(self.model.model.mtp_layers):
            callbacks.append(MtpLoss(self.model, config.model.mtp_weight, ctx.counts_tokens))
        callbacks.append(SpikeFlags(config.log))
        callbacks.append(Checkpointing(self.run_dir, config.ckpt, ctx, config.max_steps))
        if config.eval_snapshots.interval is not None:
            callbacks.append(EvalSnapshots(self.run_dir, config.eval_snapshots.interval, ctx, config.max_steps))
        return callbacks

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the weights and optimizer state: counters, schedule, data position and
        the callbacks' state."""
        callbacks = {cb.name: st for cb in self.callbacks if cb.name and (st := cb.state_dict())}
        return {"step": self.step, "tokens_seen": self.tokens_seen, **self.optimizer.schedule_state(),
                "data": self.data.state_dict(), **({"callbacks": callbacks} if callbacks else {})}  # fmt: skip

    def train_step(self, micro_batches: list[MicroBatch], data_wait: float, stop: bool = False) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's global metrics. `stop` is this
        rank's stop request; `self.stop_agreed` says afterwards whether any rank made one."""
        device, defer = self.ctx.device, self.config.model.defer_grad_sync
        for cb in self.callbacks:
            cb.on_step_data(self, micro_batches)
        micro_batches = [shard_micro_batch(mb, self.ctx.cp) for mb in micro_batches]
        for cb in self.callbacks:
            cb.on_step_start(self, micro_batches)
        counted = self.ctx.counts_tokens
        if self.pipeline is not None:
            stats = run_pipelined(self.pipeline, micro_batches, device, counted)
        else:
            stats = run_micro_batches(self.model, micro_batches, device, defer, counted)
        sums, maxes = self._reduce(stats, micro_batches, data_wait, stop)
        if maxes["record_failed"] > 0:
            raise self.record.stopped(self.step)  # before the update: the run resumes from its last checkpoint
        self.stop_agreed = maxes["stop"] > 0
        if sums["nan_count"] > 0:
            # Rare: redo the step without the bad micro-batches (on every rank, so FSDP collectives match). The
            # callbacks' step sums (MoE routing counts) are taken again from the rerun, before any of them acts on
            # them: the step then moves the routing biases as a step without the bad micro-batches would.
            for cb in self.callbacks:
                cb.on_step_start(self, micro_batches)
            finite = agreed_finite(stats.finite, self.ctx.pp)
            rerun_without_nonfinite(self.model, micro_batches, finite, device, defer, counted, self.pipeline)
            redone = self._grad_squares()
            for cb in self.callbacks:
                redone.update(cb.step_sums(self))
            again, _ = reduce_step_stats(redone, {})
            sums.update(again)
        from_callbacks: dict[str, float] = {}
        for cb in self.callbacks:
            from_callbacks.update(cb.on_step_reduced(self, sums))
        group_sq = {name: sums[f"grad_sq/{name}"] for name in self.group_lrs}
        update = self.optimizer.update(self.step + 1, group_sq, sums["loss_tokens"] > 0)
        if self.fp8_all_gather:
            precompute_fp8_scales(self.model)  # the next forward's float8 all-gathers need the new weights' scales
        self.step += 1
        self.tokens_seen += int(sums["tokens"])
        return {**self._step_metrics(sums, maxes, update), **from_callbacks, **self._group_metrics(update)}

    def _reduce(self, stats: MicroBatchStats, micro_batches: list[MicroBatch], data_wait: float,
                stop: bool) -> tuple[dict[str, Any], dict[str, float]]:  # fmt: skip
        """The step's one SUM and one MAX all-reduce over everything the metrics and callbacks need."""
        device = self.ctx.device
        wait = torch.tensor(data_wait, device=device)
        memory = torch.tensor(peak_memory_gib(device), device=device)
        # Under context parallelism every rank of a group has the whole row's segments: each counts its share. The
        # ranks of a TP group see the same rows: the first counts them.
        pairs = self.flops.pairs([mb.doc_lens for mb in micro_batches]) / self.ctx.cp.size
        pairs = pairs if self.ctx.counts_tokens else 0.0
        sums: dict[str, torch.Tensor] = {
            "loss_sum": stats.loss_sum,
            "loss_tokens": stats.loss_tokens,
            "tokens": stats.tokens,
            "nan_count": stats.nan_count,
            "data_wait": wait,
            "pairs": torch.tensor(pairs, device=device),
            "peak_memory": memory,
            **self._grad_squares(),
        }
        if stats.z_sum is not None:
            sums["z_sum"] = stats.z_sum
        pp = self.ctx.pp
        if pp.size > 1:  # each pipeline rank's stages: their ranks' peak memory, summed over those ranks
            sums["stage_memory"] = torch.nn.functional.one_hot(torch.tensor(pp.rank), pp.size).to(device) * memory
        for cb in self.callbacks:
            sums.update(cb.step_sums(self))
        maxes = {"data_wait": wait, "peak_memory": memory, "stop": torch.tensor(float(stop), device=device),
                 "record_failed": torch.tensor(float(self.record.failed()), device=device)}  # fmt: skip
        return reduce_step_stats(sums, maxes)

    def _grad_squares(self) -> dict[str, torch.Tensor]:
        """This rank's per-group squared gradient norms under their names in the step's SUM reduction, zero for
        the groups another pipeline stage holds (every rank reduces the same entries)."""
        held = self.optimizer.grad_squares(self.ctx.device)
        zero = torch.zeros((), device=self.ctx.device)
        return {f"grad_sq/{name}": held.get(name, zero) for name in self.group_lrs}

    def _step_metrics(self, sums: dict[str, Any], maxes: dict[str, float], update: OptimizerStep) -> dict[str, float]:
        loss = sums["loss_sum"] / sums["loss_tokens"] if sums["loss_tokens"] else math.nan
        world = self.ctx.world_size
        stages = {}
        if "stage_memory" in sums:
            per_rank = world // self.ctx.pp.size
            stages = {f"perf/peak_memory/pp{r}": float(m) / per_rank for r, m in enumerate(sums["stage_memory"])}
        z = {}
        if "z_sum" in sums:
            # The mean lse^2 over loss/mean's tokens: the objective is loss/mean + model.z_loss x loss/z.
            z["loss/z"] = sums["z_sum"] / sums["loss_tokens"] if sums["loss_tokens"] else math.nan
        return {
            **stages,
            "loss/mean": loss,
            **z,
            "loss/perplexity": perplexity(loss) if math.isfinite(loss) else math.nan,
            "loss/nan_count": sums["nan_count"],
            "loss/tokens": sums["loss_tokens"],
            "optim/lr": self.config.optim.lr * update.lr_multiplier,
            "optim/grad_norm": update.grad_norm,
            "optim/skipped": float(update.skipped),
            "time/data/max": maxes["data_wait"],
            "time/data/mean": sums["data_wait"] / world,
            "progress/num_tokens": float(self.tokens_seen),
            "progress/epoch": self.data.epoch,
            "perf/peak_memory": maxes["peak_memory"],
            "perf/peak_memory_mean": sums["peak_memory"] / world,
            "batch/tokens": sums["tokens"],
            "batch/pairs": sums["pairs"],
        }

    def _group_metrics(self, update: OptimizerStep) -> dict[str, float]:
        metrics = {}
        for name, base_lr in self.group_lrs.items():
            metrics[f"optim/grad_norm/{name}"] = update.group_norms[name]
            metrics[f"optim/lr/{name}"] = base_lr * update.lr_multiplier
        return metrics

    def train(self) -> None:
        """Run steps until max_steps (or a stop signal), then the callbacks' end of training.

        After each optimizer step the callbacks run in their declared order (`lmforge.train.callbacks.order`):
        MoE balancing metrics, spike flags, then `Checkpointing` saves a checkpoint when one is due (every
        `ckpt.interval` steps, the last step, a stop request), `EvalSnapshots` writes the eval worker's snapshot,
        `Validation` runs the held-out sets every `val.interval` steps, and `Reporting` logs the step last. At the
        end, `Checkpointing` finishes a background save and `Validation` runs `val.eval_on_end`'s round."""
        cfg = self.config
        stop = StopRequest()
        stop.install()
        try:
            for cb in self.callbacks:
                cb.on_train_start(self)
            last = time.perf_counter()
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                micro_batches = self.data.next_step()
                metrics = self.train_step(micro_batches, time.perf_counter() - t0, stop.requested)
                metrics["time/step"] = time.perf_counter() - last
                self._add_throughput(metrics)
                # Spike flags, checkpoint save, eval snapshot, validation, ..., logging: in the declared order.
                for cb in self.callbacks:
                    cb.after_optimizer_step(self, metrics)
                last = time.perf_counter()  # a checkpoint's time is time/save_ckpt, not the next step's time/step
                if self.stop_agreed:
                    self.stopped_by = stop.signal_name or "a stop signal on another rank"
                    break
            # Before the end of training commits the last checkpoint: not if its step's record is missing.
            self.record.agree(self.step)
            for cb in self.callbacks:
                cb.on_train_end(self)
            if self.record.failed():  # a line logged at the end (validation's last round) could not be written
                raise self.record.stopped(self.step, agreed=False)
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

    def close(self) -> None:
        """Stop the data worker, close the callbacks, the monitors and the log file."""
        self.data.close()
        for cb in self.callbacks:
            cb.close()
        self.monitors.close()
        close_logger(self.log)
