"""Multi-token prediction's part of the step (`lmforge.model.mtp`): before the step, each depth's target count over
all ranks (from the micro-batches on the host, one all-reduce on the device) sets the gradient its summed loss
gets, mtp_weight / D / count; after the step's reduction, `loss/mtp/<k>` is depth k's mean loss over its targets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lmforge.data.batch import MicroBatch
from lmforge.model.llama import CausalLM
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


def mtp_target_counts(micro_batches: Sequence[MicroBatch], depths: int) -> np.ndarray:
    """Each depth's target count [depths] in these micro-batches, by `lmforge.model.mtp.mtp_targets`'s rule: position
    t has a depth-k target where t + k + 1 is in the row and in t's document and the main loss counts t + k. Read
    from host tensors (the micro-batches before they move to the device)."""
    counts = np.zeros(depths)
    for mb in micro_batches:
        lens = mb.doc_lens.numpy()
        doc = np.repeat(np.arange(len(lens)), lens)
        counted = mb.loss_mask[0].numpy()
        t = len(doc)
        for k in range(1, depths + 1):
            if t > k + 1:
                counts[k - 1] += np.count_nonzero((doc[k + 1 :] == doc[: t - k - 1]) & counted[k : t - 1])
    return counts


class MtpLoss(Callback):
    """Sets the MTP depths' loss gradients each step and logs their losses (see the module)."""

    def __init__(self, model: CausalLM, weight: float, counts_tokens: bool = True) -> None:
        self.model = model
        self.weight = weight
        """mtp_weight (lambda)."""
        self.depths = len(model.model.mtp_layers)
        self.counts_tokens = counts_tokens
        """Whether this rank counts its rows' targets (not the other ranks of a TP group, which see the same)."""

    def on_step_start(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """Zero the step's sums and set each depth's gradient from the global target counts."""
        model = self.model
        model.mtp_loss_sum.zero_()
        model.mtp_tokens.zero_()
        local = mtp_target_counts(micro_batches, self.depths) if self.counts_tokens else np.zeros(self.depths)
        counts = torch.tensor(local, dtype=torch.float32, device=model.mtp_scale.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        model.mtp_scale.copy_(self.weight / self.depths / counts.clamp_min(1.0))

    def step_sums(self, trainer: Trainer) -> dict[str, Tensor]:
        """Each depth's summed loss and target count on this rank."""
        return {"mtp/loss": self.model.mtp_loss_sum, "mtp/tokens": self.model.mtp_tokens}

    def on_step_reduced(self, trainer: Trainer, sums: dict[str, Any]) -> dict[str, float]:
        """`loss/mtp/<k>`: depth k's mean loss over the step's targets."""
        losses, tokens = np.atleast_1d(sums["mtp/loss"]), np.atleast_1d(sums["mtp/tokens"])
        return {f"loss/mtp/{k + 1}": float(losses[k] / max(tokens[k], 1.0)) for k in range(self.depths)}
