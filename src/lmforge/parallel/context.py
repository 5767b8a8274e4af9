"""A micro-batch split for context parallelism: each rank of a CP group keeps its chunks of the row.

Every rank of a CP group gets the same micro-batches from the data stream (rows are dealt per data-parallel rank);
`shard_micro_batch` keeps this rank's two chunks of every per-token tensor (`lmforge.model.context_parallel`), so
inputs, targets, positions and the loss mask stay aligned, and keeps `seq_lens` whole: the model builds the
attention mask of the whole row from it. Counts of the whole row (`source_tokens`) stay on CP rank 0 only, so the
step's sums over all ranks count every token once.
"""

from __future__ import annotations

import torch

from lmforge.data.batch import MicroBatch
from lmforge.model.context_parallel import ContextShard

PER_TOKEN_KEYS = ("input_ids", "target_ids", "position_ids", "loss_mask")
"""Micro-batch tensors of one entry per token ([1, T]): split by CP rank."""
ROW_COUNT_KEYS = ("source_tokens",)
"""Micro-batch tensors that count the whole row: kept by CP rank 0, zero on the others."""


def shard_micro_batch(mb: MicroBatch, shard: ContextShard) -> MicroBatch:
    """This rank's part of `mb` (see the module docstring); `mb` itself when CP is off."""
    if shard.size == 1:
        return mb
    index = shard.index(int(mb["input_ids"].shape[1]))
    out: MicroBatch = {}
    for key, value in mb.items():
        if key in PER_TOKEN_KEYS:
            out[key] = value[:, index]
        elif key in ROW_COUNT_KEYS:
            out[key] = value if shard.rank == 0 else torch.zeros_like(value)
        elif key == "seq_lens":
            out[key] = value
        else:
            raise ValueError(f"micro-batch field {key!r} has no context-parallel split")
    return out
