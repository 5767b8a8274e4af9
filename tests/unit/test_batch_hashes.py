"""Batch fingerprints: a micro-batch's hash sees every token, target and loss flag; a step's hash gathered from
ranks that share rows (context, tensor, pipeline parallelism) equals the hash of the step's micro-batches in order."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from lmforge.data.batch import MicroBatch, Window, pack_windows
from lmforge.data.batch_hash import micro_batch_hash, step_hash
from lmforge.train.callbacks.batch_hashes import BatchHashes


def batch(seed: int) -> MicroBatch:
    rng = np.random.default_rng(seed)
    return pack_windows([Window(rng.integers(0, 100, 17), [9, 7], rng.random(16) < 0.8) for _ in range(2)])


@dataclass
class Ctx:
    dp_rank: int
    dp_size: int
    counts_rows: bool
    device: str = "cpu"


def test_a_micro_batch_hash_changes_with_any_token_target_loss_flag_or_document_cut() -> None:
    mb = batch(0)
    base = micro_batch_hash(mb)
    assert base == micro_batch_hash(batch(0)) and 0 < base < 2**48
    for name in ("input_ids", "target_ids", "loss_mask"):
        values = getattr(mb, name).clone()
        values[0, 5] = ~values[0, 5] if values.dtype == torch.bool else values[0, 5] + 1
        assert micro_batch_hash(MicroBatch(**{**mb.__dict__, name: values})) != base, name
    moved = MicroBatch(**{**mb.__dict__, "doc_lens": torch.tensor([10, 6, 9, 7], dtype=torch.int32)})
    assert micro_batch_hash(moved) != base


def test_the_step_hash_gathered_over_dp_and_cp_ranks_is_that_of_the_micro_batches_in_order() -> None:
    steps = [batch(i) for i in range(6)]  # 3 micro-batches on each of 2 data-parallel ranks
    total = np.zeros(6)
    for dp_rank in range(2):
        for cp_rank in range(2):  # both ranks of a context-parallel pair get the same whole rows
            cb = BatchHashes()
            trainer = SimpleNamespace(ctx=Ctx(dp_rank, 2, counts_rows=cp_rank == 0))
            cb.on_step_data(trainer, steps[3 * dp_rank : 3 * dp_rank + 3])  # type: ignore[arg-type]
            total += cb.step_sums(trainer)["batch_hashes"].numpy()  # type: ignore[arg-type]
    logged = BatchHashes().on_step_reduced(None, {"batch_hashes": total})["batch/hash"]  # type: ignore[arg-type]
    assert logged == float(step_hash([micro_batch_hash(mb) for mb in steps]))
    assert logged != float(step_hash([micro_batch_hash(mb) for mb in reversed(steps)]))
