"""MoE routing statistics and auxiliary-loss-free load balancing, once per optimizer step.

Every MoE block counts, on the device, the token copies routed to each expert and the router score mass of the
chosen experts (`lmforge.model.moe`). The trainer zeroes those buffers before a step's micro-batches and adds them
to the step's single SUM all-reduce, so the counts here are the step's global ones on every rank. From them:

- the bias update, identically on every rank, until `freeze_at` x max_steps: with `rule = "sign"` each block's
  selection bias moves by coeff x sign(mean load - expert load) (DeepSeek-V3's rule); with `rule = "quantile"` the
  routers also add a histogram of each choice's selection values to the step's sums, and the bias moves towards
  the value that gives every choice the same expected load (`quantile_bias`);
- with `seq_aux_coeff`, the scale of the sequence-wise balance loss's gradient: seq_aux_coeff / (segments in the
  step over all ranks), set on every block before the step's micro-batches (`lmforge.model.moe`), and its value
  `moe/seq_aux_loss`;
- the metrics: `max_vio/{mean,max}`, `routing_confidence/mean`, `expert_load/{min_mean,max_mean,cv,entropy}/*`,
  `expert_load/dead`, `expert_load/cold`, `expert_load/layer_<i>/*`, `moe/bias/{abs_mean,flips}`, with null
  experts `moe/null_share` and `moe/real_k` (the expert-load statistics cover the real experts), and the per-rank
  load `moe/rank_load/{mean,max}` (token copies each rank's experts computed: under expert parallelism, what a rank
  received from its group).

Nothing here reads the device inside a step: the counts arrive on the host with the step's reduction, the rules
move a host copy of the biases (taken from the device once, when training starts) and upload it, and the metrics
come from that copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmforge.config.model import MoEBalanceConfig
from lmforge.data.batch import MicroBatch
from lmforge.model.moe import MoE, sign_rule
from lmforge.parallel.stages import NO_PIPELINE, PipeShard
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


COLD_SHARE = 0.1
"""An expert is cold in a step when its load is under this share of the mean load of its layer."""

START_RANGE = {"scores": (0.0, 1.0), "logits": (-1.0, 1.0)}
"""The quantile rule's first histogram range for selection values that are sigmoid scores or router logits; from
the second step on, each layer's range follows its values (`next_range`)."""


def histogram_quantiles(hist: np.ndarray, lo: float, hi: float, level: float) -> np.ndarray:
    """The `level` quantile of each row of hist [choices, bins] (counts over equal bins of [lo, hi]), read by
    linear interpolation inside the bin where the cumulative count reaches level x the row's total. Values that
    fell outside [lo, hi] count in the edge bins, so a quantile there is clipped to the range."""
    hist = np.asarray(hist, dtype=np.float64)
    bins = hist.shape[1]
    cum = np.cumsum(hist, axis=1)
    target = level * cum[:, -1:]
    # First bin whose cumulative count reaches the target (a row of zeros has no quantile: its NaN is left).
    index = np.minimum((cum < target).sum(axis=1), bins - 1)
    rows = np.arange(hist.shape[0])
    before = np.where(index > 0, cum[rows, np.maximum(index - 1, 0)], 0.0)
    inside = hist[rows, index]
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(inside > 0, (target[:, 0] - before) / inside, 0.5)
    quantiles = lo + (hi - lo) * (index + np.clip(frac, 0.0, 1.0)) / bins
    return np.where(cum[:, -1] > 0, quantiles, np.nan)


def quantile_bias(hist: np.ndarray, lo: float, hi: float, top_k: int) -> np.ndarray:
    """The selection bias [choices] that gives every choice the same expected load: with q_e the (1 - k / choices)
    quantile of choice e's values, bias_e = mean(q) - q_e, so each choice's biased values exceed the common level
    mean(q) for the same share k / choices of the tokens (a token's k largest biased values choose its experts)."""
    q = histogram_quantiles(hist, lo, hi, 1.0 - top_k / hist.shape[0])
    return q.mean() - q


def next_range(hist: np.ndarray, lo: float, hi: float) -> tuple[float, float]:
    """The next step's histogram range from this step's histogram [choices, bins] over [lo, hi]: twice the span of
    the occupied bins, centred on them; a range whose edge bin holds values (which may lie beyond it) grows by its
    span on that side instead. An empty histogram keeps the range."""
    occupied = np.flatnonzero(np.asarray(hist).sum(axis=0) > 0)
    if occupied.size == 0:
        return lo, hi
    bins, span = hist.shape[1], hi - lo
    first, last = int(occupied[0]), int(occupied[-1])
    if first == 0 or last == bins - 1:
        return lo - span * (first == 0), hi + span * (last == bins - 1)
    a, b = lo + span * first / bins, lo + span * (last + 1) / bins
    return a - (b - a) / 2, b + (b - a) / 2


def load_stats(counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer load statistics of counts [layers, experts] (token copies per expert in one step).

    `max_vio`: max load / mean load - 1; `min_mean` and `max_mean`: min and max load over the mean; `cv`: standard
    deviation over mean; `entropy`: entropy of the load distribution divided by ln(experts) (1 = uniform);
    `dead`: experts that got no token; `cold`: experts under `COLD_SHARE` of the mean load (dead ones included).
    A layer without tokens has no defined ratios (NaN) and all experts dead.
    """
    counts = np.asarray(counts, dtype=np.float64)
    num_experts = counts.shape[1]
    mean = counts.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = counts / counts.sum(axis=1, keepdims=True)
        logs = np.where(share > 0, np.log(np.where(share > 0, share, 1.0)), 0.0)
        return {
            "max_vio": counts.max(axis=1) / mean - 1.0,
            "min_mean": counts.min(axis=1) / mean,
            "max_mean": counts.max(axis=1) / mean,
            "cv": counts.std(axis=1) / mean,
            "entropy": -(share * logs).sum(axis=1) / math.log(num_experts),
            "dead": (counts == 0).sum(axis=1).astype(np.float64),
            "cold": ((counts < COLD_SHARE * mean[:, None]) | (counts == 0)).sum(axis=1).astype(np.float64),
        }


def load_metrics(counts: np.ndarray, confidence_sums: np.ndarray, top_k: int, layers: list[int],
                 null_counts: np.ndarray | None = None) -> dict[str, float]:  # fmt: skip
    """The step's routing metrics from global counts [L, E] and confidence sums [L] of the MoE layers `layers`;
    with null experts, their counts [L, N] add `moe/null_share` (null choices over all choices) and `moe/real_k`
    (real experts per token), and the expert-load statistics stay those of the real experts."""
    stats = load_stats(counts)
    choices = np.asarray(counts, dtype=np.float64).sum(axis=1)
    nulls = np.zeros_like(choices) if null_counts is None else np.asarray(null_counts, dtype=np.float64).sum(axis=1)
    tokens = (choices + nulls) / top_k
    with np.errstate(divide="ignore", invalid="ignore"):
        confidence = np.asarray(confidence_sums, dtype=np.float64) / tokens
    out = {
        "max_vio/mean": float(np.mean(stats["max_vio"])),
        "max_vio/max": float(np.max(stats["max_vio"])),
        "routing_confidence/mean": float(np.mean(confidence)),
        "expert_load/min_mean/mean": float(np.mean(stats["min_mean"])),
        "expert_load/min_mean/min": float(np.min(stats["min_mean"])),
        "expert_load/max_mean/mean": float(np.mean(stats["max_mean"])),
        "expert_load/max_mean/max": float(np.max(stats["max_mean"])),
        "expert_load/cv/mean": float(np.mean(stats["cv"])),
        "expert_load/cv/max": float(np.max(stats["cv"])),
        "expert_load/entropy/mean": float(np.mean(stats["entropy"])),
        "expert_load/entropy/min": float(np.min(stats["entropy"])),
        "expert_load/dead": float(np.sum(stats["dead"])),
        "expert_load/cold": float(np.sum(stats["cold"])),
    }
    for row, layer in enumerate(layers):
        for name in ("max_vio", "cv", "entropy", "min_mean", "max_mean", "dead", "cold"):
            out[f"expert_load/layer_{layer}/{name}"] = float(stats[name][row])
    if null_counts is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            out["moe/null_share"] = float(np.mean(nulls / (choices + nulls)))
            out["moe/real_k"] = float(np.mean(choices / tokens))
    return out


class MoEBalancer(Callback):
    """Reads the MoE blocks' step statistics and moves their selection biases: a callback of every MoE run."""

    def __init__(
        self,
        model: nn.Module,
        cfg: MoEBalanceConfig,
        coeff_override: float | None,
        max_steps: int,
        counts_segments: bool = True,
        whole: nn.Module | None = None,
        pipeline: PipeShard = NO_PIPELINE,
    ) -> None:
        """`coeff_override` is the arch's `load_balance_coeff` (GLM-4.5 style), which wins over `cfg.coeff`;
        `counts_segments` is False on the ranks of a context- or tensor-parallel group but its first, which see the
        same rows (each segment is counted once). Under pipeline parallelism `model` holds this rank's stages only:
        `whole` is the whole model (on the meta device), whose MoE blocks the step's tables cover, and `pipeline`
        the group over which the ranks' biases add up to every block's once."""
        held: dict[int, MoE] = model.moe_layers()  # type: ignore[operator]
        every: dict[int, MoE] = (whole or model).moe_layers()  # type: ignore[operator]
        self.layers = sorted(every)
        """Every MoE block's decoder-layer index: the rows of the step's tables."""
        self.blocks = [held[i] for i in self.layers if i in held]
        """The blocks this rank holds."""
        self.rows = [self.layers.index(i) for i in self.layers if i in held]
        """Their rows in the step's tables."""
        spec = every[self.layers[0]].spec
        self.top_k, self.num_experts, self.null_experts = spec.top_k, spec.num_experts, spec.null_experts
        self.coeff = cfg.coeff if coeff_override is None else coeff_override
        self.freeze_step = None if cfg.freeze_at is None else math.floor(cfg.freeze_at * max_steps)
        self.balanced_layers = [i for i in self.layers if every[i].spec.selection_bias]
        """The layers of the blocks with a selection bias: the rows of the host bias copy and the histograms."""
        self.balanced = [held[i] for i in self.balanced_layers if i in held]
        self.balanced_rows = [r for r, i in enumerate(self.balanced_layers) if i in held]
        """The held balanced blocks' rows among `balanced_layers`."""
        self._last_sign: Tensor | None = None
        self._bias: Tensor | None = None
        """Host copy of every balanced block's selection bias [blocks, choices], in the buffers' dtype (held on this
        rank or not): the rules move it and upload the held rows, so a step never reads the biases back
        (`read_biases`)."""
        self.pipeline = pipeline
        self.quantile_bins = cfg.quantile_bins
        self.quantile_rate = cfg.quantile_rate
        self.quantile = cfg.rule == "quantile" and self.coeff > 0 and bool(self.balanced_layers)
        bias_on_logits = bool(self.balanced_layers) and every[self.balanced_layers[0]].spec.bias_on_logits
        start = START_RANGE["logits" if self.quantile and bias_on_logits else "scores"]
        self.ranges: list[tuple[float, float]] = [start] * len(self.balanced_layers)
        """Each balanced block's histogram range for the next step (quantile rule; kept in checkpoints)."""
        self._recording = False
        self.seq_aux_coeff = cfg.seq_aux_coeff
        for block in self.blocks:
            block.seq_aux = self.seq_aux_coeff > 0
        self._local_segments: Tensor | None = None
        self.counts_segments = counts_segments

    name = "moe_balance"

    def read_biases(self) -> Tensor:
        """Take the host copy of the biases from the device (once, when training starts: after a resume has
        loaded them); returns it. Under pipeline parallelism each rank reads its stages' and one all-reduce over
        the pipeline group gives every rank all of them."""
        held = torch.stack([b.gate.e_score_correction_bias.detach() for b in self.balanced]) if self.balanced else None
        if self.pipeline.size == 1:
            assert held is not None
            self._bias = held.cpu()
            return self._bias
        spec_width = self.num_experts + self.null_experts
        table = torch.zeros(len(self.balanced_layers), spec_width, device=self._device(), dtype=torch.float32)
        if held is not None:
            table[self.balanced_rows] = held.float()
        dist.all_reduce(table, group=self.pipeline.group)
        dtype = held.dtype if held is not None else torch.float32
        self._bias = table.cpu().to(dtype)
        return self._bias

    def on_train_start(self, trainer: Trainer) -> None:
        """Read the biases the run starts from (see `read_biases`)."""
        if self.balanced_layers:
            self.read_biases()

    def active(self, step: int) -> bool:
        """Whether step `step` (1-based) moves the biases: balancing on and not yet frozen."""
        return self.coeff > 0 and (self.freeze_step is None or step <= self.freeze_step)

    def start_step(self, micro_batches: Sequence[MicroBatch], step: int | None = None) -> None:
        """Zero the blocks' statistics before the first micro-batch of step `step`; under the quantile rule, have
        the routers record histograms over their ranges while the step moves the biases (not once frozen); with
        the sequence-wise loss on, count the step's segments over all ranks (one all-reduce on the device) and set
        its gradient scale."""
        for block in self.blocks:
            block.reset_stats()
        self._recording = self.quantile and (step is None or self.active(step))
        for block, (lo, hi) in zip(self.balanced, [self.ranges[r] for r in self.balanced_rows], strict=True):
            if self._recording:
                block.gate.start_recording(self.quantile_bins, lo, hi)
            else:
                block.gate.record_choices = False
        if self.seq_aux_coeff > 0:
            device = self._device()
            local = float(sum(len(mb.doc_lens) for mb in micro_batches)) if self.counts_segments else 0.0
            segments = torch.tensor(local, device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(segments)
            # The global count again with the step's reduction, on the host, for `moe/seq_aux_loss`.
            self._local_segments = torch.tensor(local, device=device)
            for block in self.blocks:
                block.aux_scale.copy_(self.seq_aux_coeff / segments)

    def device_stats(self) -> dict[str, Tensor]:
        """This rank's step statistics, for the step's SUM all-reduce: counts [L, E], confidence sums [L], the
        sequence-wise loss sums [L] and the copies each rank's experts computed [L, world] (this rank's column
        filled, so the sum holds every rank's)."""
        rows, n, width = self.rows, len(self.layers), self.num_experts + self.null_experts
        computed = self._table([b.experts.tokens_computed for b in self.blocks], rows, n, ())
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        per_rank = torch.zeros(n, world, device=computed.device)
        per_rank[:, rank] = computed
        sums = {
            "moe/counts": self._table([b.tokens_per_expert for b in self.blocks], rows, n, (width,)),
            "moe/confidence": self._table([b.routing_confidence_sum for b in self.blocks], rows, n, ()),
            "moe/seq_aux": self._table([b.seq_aux_sum for b in self.blocks], rows, n, ()),
            "moe/rank_load": per_rank,
        }
        if self._local_segments is not None:
            sums["moe/segments"] = self._local_segments
        if self._recording:
            # [balanced blocks, choices, bins]: under context parallelism each rank holds its own tokens' values.
            hists = [b.gate.choice_histogram for b in self.balanced]
            shape = (width, self.quantile_bins)
            sums["moe/choice_hist"] = self._table(hists, self.balanced_rows, len(self.balanced_layers), shape)
        return sums

    def _device(self) -> torch.device:
        """Where the step's tables live (the held blocks' device; a rank holding none under pipeline parallelism
        has its buffers nowhere, and uses the CPU only with gloo)."""
        if self.blocks:
            return self.blocks[0].aux_scale.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _table(self, held: list[Tensor], rows: list[int], n: int, shape: tuple[int, ...]) -> Tensor:
        """The held blocks' tensors (each of `shape`) stacked into their `rows` of an n-row table, zeros in the
        other blocks' rows: every rank then adds the same entries in the step's reduction."""
        if len(held) == n:
            return torch.stack(held)
        table = torch.zeros(n, *shape, device=self._device())
        if held:
            table[rows] = torch.stack(held).to(table.dtype)
        return table

    def update(self, step: int, counts: np.ndarray, confidence_sums: np.ndarray, seq_aux_sums: np.ndarray | None = None,
               rank_load: np.ndarray | None = None, hist: np.ndarray | None = None,
               segments: float | None = None) -> dict[str, float]:  # fmt: skip
        """After step `step`'s reduction: move the biases (unless off or frozen) and return the step's metrics;
        `hist` holds the quantile rule's global histograms [balanced blocks, choices, bins] of the step, `segments`
        the step's segments over all ranks (with the sequence-wise loss)."""
        real = self.num_experts
        nulls = counts[:, real:] if self.null_experts else None
        metrics = load_metrics(counts[:, :real], confidence_sums, self.top_k, self.layers, nulls)
        if rank_load is not None:
            # Copies computed per rank and MoE layer: their mean, and the most any rank computed in one layer. Under
            # pipeline parallelism a layer's copies are computed by the world size / pp ranks holding its stage.
            metrics["moe/rank_load/mean"] = float(np.mean(rank_load)) * self.pipeline.size
            metrics["moe/rank_load/max"] = float(np.max(rank_load))
        if segments and seq_aux_sums is not None:
            # The objective's term: coeff x the mean over segments of each block's loss, summed over blocks.
            metrics["moe/seq_aux_loss"] = self.seq_aux_coeff * float(np.sum(seq_aux_sums)) / segments
        if not self.balanced_layers:
            return metrics
        if self.quantile and hist is not None:
            signs = [torch.sign(d) for d in self._quantile_update(hist)]
            edge = hist[:, :, [0, -1]].sum(axis=(1, 2)) / hist.sum(axis=(1, 2))
            metrics["moe/quantile/edge_share"] = float(np.mean(edge))
        elif not self.quantile and self.active(step):
            signs = [torch.sign(d) for d in self._sign_update(counts)]
        else:
            signs = []
        if signs:
            sign = torch.stack(signs)
            flips = 0.0 if self._last_sign is None else float((sign * self._last_sign < 0).sum())
            self._last_sign = sign
            metrics["moe/bias/flips"] = flips
        metrics["moe/bias/abs_mean"] = float(self._biases().float().abs().mean())
        return metrics

    def _biases(self) -> Tensor:
        """The host copy of the biases (read from the device at the first use when training did not start it)."""
        return self._bias if self._bias is not None else self.read_biases()

    def _sign_update(self, counts: np.ndarray) -> list[Tensor]:
        """DeepSeek-V3's sign rule (`sign_rule`) on the host copy: each balanced block's bias moves by coeff towards
        its under-loaded experts, then is uploaded; returns the changes."""
        bias, deltas = self._biases(), []
        for i, layer in enumerate(self.balanced_layers):
            delta = sign_rule(torch.from_numpy(counts[self.layers.index(layer)]), self.coeff)
            bias[i] += delta.to(bias.dtype)
            deltas.append(delta)
        self._upload(bias)
        return deltas

    def _upload(self, bias: Tensor) -> None:
        """Set the held balanced blocks' biases from their rows of the host copy."""
        for row, block in zip(self.balanced_rows, self.balanced, strict=True):
            block.gate.set_bias(bias[row])

    def _quantile_update(self, hist: np.ndarray) -> list[Tensor]:
        """Move each balanced block's bias `quantile_rate` of the way to `quantile_bias` of its histogram (on the host
        copy, then uploaded) and set its next range; returns the changes."""
        bias = self._biases()
        current = bias.double().numpy()
        deltas = []
        for row in range(len(self.balanced_layers)):
            lo, hi = self.ranges[row]
            delta = np.zeros_like(current[row])  # unchanged when no token reached this block in the step
            if hist[row].sum() > 0:
                delta = self.quantile_rate * (quantile_bias(hist[row], lo, hi, self.top_k) - current[row])
            bias[row] = torch.from_numpy(current[row] + delta).to(bias.dtype)
            deltas.append(torch.from_numpy(delta))
            self.ranges[row] = next_range(hist[row], lo, hi)
        self._upload(bias)
        return deltas

    def state_dict(self) -> dict[str, Any]:
        """The quantile rule's histogram grid (bins and each block's next range), so a resumed run bins alike."""
        if not self.quantile:
            return {}
        return {"quantile_bins": self.quantile_bins, "ranges": [list(r) for r in self.ranges]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the grid; a checkpoint with another bin count or number of blocks is refused."""
        if not self.quantile or "ranges" not in state:
            return
        if state["quantile_bins"] != self.quantile_bins or len(state["ranges"]) != len(self.balanced_layers):
            raise ValueError(
                f"the checkpoint's quantile balancing grid ({state['quantile_bins']} bins, {len(state['ranges'])} "
                f"blocks) differs from this run's (model.moe_balance.quantile_bins {self.quantile_bins}, "
                f"{len(self.balanced_layers)} blocks)"
            )
        self.ranges = [(float(lo), float(hi)) for lo, hi in state["ranges"]]

    def on_step_start(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """See `start_step`."""
        self.start_step(micro_batches, trainer.step + 1)

    def step_sums(self, trainer: Trainer) -> dict[str, Tensor]:
        """See `device_stats`."""
        return self.device_stats()

    def on_step_reduced(self, trainer: Trainer, sums: dict[str, Any]) -> dict[str, float]:
        """Move the biases from the step's global counts (before the optimizer update) and return the routing
        metrics of step `trainer.step + 1`."""
        return self.update(trainer.step + 1, sums["moe/counts"], sums["moe/confidence"], sums["moe/seq_aux"],
                           sums["moe/rank_load"], sums.get("moe/choice_hist"), sums.get("moe/segments"))  # fmt: skip


def moe_balancer(
    model: nn.Module,
    cfg: MoEBalanceConfig,
    max_steps: int,
    counts_segments: bool = True,
    whole: nn.Module | None = None,
    pipeline: PipeShard = NO_PIPELINE,
) -> MoEBalancer | None:
    """The balancer of `model`'s MoE layers (under pipeline parallelism: of `whole`'s, the rank holding some of
    them), None without any; the arch's `load_balance_coeff` (GLM-4.5 style) wins over `cfg.coeff`;
    `counts_segments`: whether this rank counts its rows' segments (see `MoEBalancer`)."""
    if not (whole or model).moe_layers():  # type: ignore[operator]
        return None
    coeff = getattr(model.arch, "load_balance_coeff", None)
    return MoEBalancer(model, cfg, coeff, max_steps, counts_segments, whole, pipeline)
