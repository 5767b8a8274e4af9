"""Forward and backward over one optimizer step's micro-batches.

The loss of a step is the mean over every loss token of the global batch. Its denominator, the global count of
loss tokens, is known before the first backward (summed on the device over this rank's micro-batches, then one
all-reduce), so each micro-batch backpropagates `sum of its token losses / global count` and the accumulated
gradient is exactly that of the mean. Nothing in the loop reads a device value on the host: statistics stay on
the device until the step's single reduction.

With a z-loss (`model.z_loss` > 0) the model's loss carries the gradient of CE + z_loss x sum of lse^2 and keeps
the value of the CE; the loop collects each micro-batch's sum of lse^2 (`CausalLM.z_sum`) beside its CE sum, and a
micro-batch is finite only when both are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lmforge.data.batch import MicroBatch, null_micro_batch
from lmforge.model.llama import CausalLM
from lmforge.model.loss import IGNORE_INDEX
from lmforge.parallel.pipeline import Pipeline
from lmforge.parallel.stages import PipeShard


@dataclass
class MicroBatchStats:
    """Device-side sums over this rank's micro-batches of one step."""

    loss_sum: Tensor
    """fp64 sum of token losses of the finite micro-batches."""
    loss_tokens: Tensor
    """Loss tokens of the finite micro-batches."""
    tokens: Tensor
    """All tokens processed (finite or not)."""
    nan_count: Tensor
    """Micro-batches whose loss was not finite."""
    finite: Tensor
    """bool [micro-batches]: which micro-batches had a finite loss."""
    z_sum: Tensor | None = None
    """With a z-loss: fp64 sum of lse^2 over the loss tokens of the finite micro-batches; None without."""


def token_loss_sum(model: nn.Module, mb: MicroBatch) -> Tensor:
    """Sum of the cross-entropy (fp32) over the loss tokens of one micro-batch (the model computes it, in chunks
    when its `loss_chunk_tokens` is set)."""
    targets = mb.target_ids.masked_fill(~mb.loss_mask, IGNORE_INDEX)
    return model(mb.input_ids, mb.position_ids, mb.doc_lens, targets=targets)


def global_loss_tokens(micro_batches: Sequence[MicroBatch], counted: bool = True) -> Tensor:
    """Loss tokens of the whole step over all ranks, as a device scalar (one all-reduce, no host read); a rank
    whose tokens another rank counts (`counted` False: the other ranks of a TP group) adds none."""
    count = torch.stack([mb.loss_mask.sum() for mb in micro_batches]).sum().float()
    if not counted:
        count = torch.zeros_like(count)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count)
    return count.clamp_min(1.0)


def _set_sync(model: nn.Module, sync: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        model.set_reshard_after_backward(sync)


def run_micro_batches(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    device: torch.device,
    defer_grad_sync: bool = False,
    counted: bool = True,
) -> MicroBatchStats:
    """Accumulate the gradient of the step's mean token loss over this rank's micro-batches.

    With `defer_grad_sync`, FSDP reduce-scatters only after the last micro-batch. A micro-batch whose loss is not
    finite is counted and excluded from the loss statistics; its gradient is removed by `rerun_without_nonfinite`.
    With `counted` False (a TP rank other than its group's first, which sees the same tokens), the statistics
    are zero, so that summed over ranks every token counts once.
    """
    n = len(micro_batches)
    on_device = [mb.to(device, non_blocking=True) for mb in micro_batches]  # token tensors are small; copies overlap
    denom = global_loss_tokens(on_device, counted)
    with_z = model if isinstance(model, CausalLM) and model.z_loss > 0 and model.training else None
    ce_sums, z_sums = [], []
    for i, mb in enumerate(on_device):
        if defer_grad_sync:
            _set_sync(model, i == n - 1)
        ce_sum = token_loss_sum(model, mb)
        (ce_sum / denom).backward()
        ce_sums.append(ce_sum.detach())
        if with_z is not None:
            assert with_z.z_sum is not None, "a training forward with z_loss > 0 sets z_sum"
            z_sums.append(with_z.z_sum)
    if defer_grad_sync:
        _set_sync(model, True)
    return step_stats(ce_sums, on_device, device, counted, z_sums if with_z is not None else None)


def step_stats(
    ce_sums: Sequence[Tensor],
    micro_batches: Sequence[MicroBatch],
    device: torch.device,
    counted: bool = True,
    z_sums: Sequence[Tensor] | None = None,
) -> MicroBatchStats:
    """The statistics of a step from each micro-batch's summed token loss (and with a z-loss its summed lse^2,
    `z_sums`). Where `counted` is False (a rank whose tokens another rank counts) the sums are zero but the finite
    flags still this rank's; a pipeline rank without the loss passes no sums and gets every micro-batch finite (see
    `agreed_finite`)."""
    zero = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    z_sum = loss_sum.clone() if z_sums is not None else None
    loss_tokens, tokens, nan_count = zero.clone(), zero.clone(), zero.clone()
    finite_flags = torch.ones(len(micro_batches), dtype=torch.bool, device=device)
    with torch.no_grad():
        for i, (ce_sum, mb) in enumerate(zip(ce_sums, micro_batches, strict=True) if ce_sums else ()):
            finite = torch.isfinite(ce_sum)
            if z_sum is not None and z_sums is not None:
                # The z term is part of what the micro-batch trains on: a non-finite one skips it as a whole too.
                finite = finite & torch.isfinite(z_sums[i])
                z_sum += torch.where(finite, z_sums[i].double(), 0.0)
            finite_flags[i] = finite
            loss_sum += torch.where(finite, ce_sum.double(), 0.0)
            loss_tokens += torch.where(finite, mb.loss_mask.sum().float(), 0.0)
            tokens += mb.input_ids.numel()
            nan_count += (~finite).float()
    if not counted:
        zeroed = (torch.zeros_like(t) for t in (loss_sum, loss_tokens, tokens, nan_count))
        loss_sum, loss_tokens, tokens, nan_count = zeroed
        z_sum = None if z_sum is None else torch.zeros_like(z_sum)
    return MicroBatchStats(loss_sum, loss_tokens, tokens, nan_count, finite_flags, z_sum)


def run_pipelined(
    pipeline: Pipeline, micro_batches: Sequence[MicroBatch], device: torch.device, counted: bool = True
) -> MicroBatchStats:
    """`run_micro_batches` under pipeline parallelism: the step's schedule runs every micro-batch through this
    rank's stages; the rank computing the loss has the statistics (`counted`), the others zeros."""
    on_device = [mb.to(device, non_blocking=True) for mb in micro_batches]
    denom = global_loss_tokens(on_device, counted)
    return step_stats(pipeline.step(on_device, denom), on_device, device, counted)


def rerun_without_nonfinite(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    finite: Sequence[bool],
    device: torch.device,
    defer_grad_sync: bool = False,
    counted: bool = True,
    pipeline: Pipeline | None = None,
) -> None:
    """Recompute the step's gradient with every non-finite micro-batch replaced by one that adds nothing (through
    `pipeline`'s schedule under pipeline parallelism; `finite` then from `agreed_finite`).

    Called on every rank when any rank saw a non-finite loss (known after the step's reduction), so all ranks run
    the same number of forward/backward passes and FSDP's collectives stay matched. Gradients are zeroed first;
    the result is the gradient of the mean loss over the finite micro-batches' tokens.
    """
    model.zero_grad(set_to_none=True)
    kept = [mb if ok else null_micro_batch(mb) for mb, ok in zip(micro_batches, finite, strict=True)]
    if pipeline is not None:
        run_pipelined(pipeline, kept, device, counted)
    else:
        run_micro_batches(model, kept, device, defer_grad_sync, counted)


def agreed_finite(finite: Tensor, pp: PipeShard) -> list[bool]:
    """Which micro-batches had a finite loss, on every rank of a pipeline group (only the rank computing the loss
    knows: one all-reduce over the group, on the rare step that reruns). Without pipeline parallelism, this rank's
    own flags."""
    if pp.size == 1:
        return finite.tolist()
    bad = (~finite).float()
    dist.all_reduce(bad, group=pp.group)
    return (bad == 0).tolist()
