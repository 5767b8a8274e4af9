"""Fingerprints of the data a step trained on: a short hash of each micro-batch and of a whole step.

A micro-batch's hash covers everything that decides what it trains on (token ids, targets, loss mask and document
lengths), read from the host tensors the data worker built, so it costs no device work. A step's hash combines the
hashes of its micro-batches in their global order (rank by rank, each rank's in order), which does not depend on
the number of ranks: `lmforge replay --verify` recomputes it in one process for a run trained on many.

Hashes are 48-bit integers, exact as float64: they travel in the step's one float64 SUM reduction (each slot is
written by one rank and zero on the others) and are logged in metrics.jsonl as plain numbers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from lmforge.data.batch import MicroBatch

HASH_BYTES = 6
"""Digest size: 48 bits, exact in a float64 (53-bit mantissa)."""


def _digest(parts: Sequence[bytes]) -> int:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def micro_batch_hash(mb: MicroBatch) -> int:
    """The 48-bit hash of a micro-batch's token ids, targets, loss mask and document lengths."""
    fields = (mb.input_ids, mb.target_ids, mb.loss_mask, mb.doc_lens)
    dtypes = (np.int64, np.int64, np.uint8, np.int64)
    return _digest([np.ascontiguousarray(t.numpy(), dtype=d).tobytes() for t, d in zip(fields, dtypes, strict=True)])


def step_hash(micro_batch_hashes: Sequence[int]) -> int:
    """The 48-bit hash of a step: its micro-batches' hashes in global order."""
    return _digest([np.asarray(micro_batch_hashes, dtype=np.uint64).tobytes()])
