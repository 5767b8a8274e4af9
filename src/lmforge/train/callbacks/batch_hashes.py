"""`batch/hash` (with `log.batch_hashes = true`): a fingerprint of the data each step trained on.

Every data-parallel rank hashes its whole micro-batches on the host (`lmforge.data.batch_hash`) and writes each
hash into the slot of its global micro-batch index (rank `r` of the step's `R` data-parallel ranks holds micro-batches
`r * M / R ..`); the other slots are zero, so the step's float64 SUM reduction gathers every hash exactly. The step's
hash combines them in global order, the order `lmforge replay --verify` rebuilds in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lmforge.data.batch import MicroBatch
from lmforge.data.batch_hash import micro_batch_hash, step_hash
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class BatchHashes(Callback):
    """Hashes the step's micro-batches and logs the step's hash as `batch/hash`."""

    def __init__(self) -> None:
        self._slots = np.zeros(0, dtype=np.float64)

    def on_step_data(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """Hash this rank's micro-batches into their global slots; only one rank of each group that shares rows
        (the ranks of a context-, tensor- or pipeline-parallel group) writes them."""
        ctx = trainer.ctx
        per_rank = len(micro_batches)
        self._slots = np.zeros(per_rank * ctx.dp_size, dtype=np.float64)
        if ctx.counts_rows:
            first = ctx.dp_rank * per_rank
            self._slots[first : first + per_rank] = [micro_batch_hash(mb) for mb in micro_batches]

    def step_sums(self, trainer: Trainer) -> dict[str, Tensor]:
        """The slots, gathered by the step's SUM reduction."""
        return {"batch_hashes": torch.from_numpy(self._slots).to(trainer.ctx.device)}

    def on_step_reduced(self, trainer: Trainer, sums: dict[str, Any]) -> dict[str, float]:
        """`batch/hash`: the step's hash, a 48-bit integer (exact as a float)."""
        hashes = np.atleast_1d(sums["batch_hashes"]).astype(np.uint64).tolist()
        return {"batch/hash": float(step_hash(hashes))}
