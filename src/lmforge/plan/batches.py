"""The micro-batches a plan's step trains on: rank 0's share of the first step of the run's own data when it is
there, else windows of the configured shape whose documents have a stated length distribution."""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config.data import FakeDataConfig
from lmforge.config.train import TrainConfig
from lmforge.data.batch import MicroBatch
from lmforge.data.fake import FakeData
from lmforge.data.stream import DataError, build_step_data
from lmforge.data.tokenizer import TokenizerInfo

DEFAULT_DOC_LEN = 1024.0
"""Mean document length (tokens, geometric) of the stated distribution, when the run's data is not at hand."""


@dataclass
class PlanBatches:
    """Rank 0's micro-batches of one step and where their document lengths come from."""

    micro_batches: list[MicroBatch]
    """The rank's micro-batches, whole rows (context parallelism splits them as training does)."""
    source: str
    """Where the lengths come from, for the report."""


def stated_batches(config: TrainConfig, dp_size: int, doc_len: float) -> PlanBatches:
    """Windows of the configured shape whose documents have geometric lengths of mean `doc_len` (one segment per
    window without document masking), through the fake data type's own path."""
    data = config.data
    fake = FakeDataConfig(seq_len=data.seq_len, batch_tokens=data.batch_tokens,
                          micro_batch_tokens=data.micro_batch_tokens, seed=data.seed,
                          document_masking=data.document_masking, mean_doc_len=doc_len)  # fmt: skip
    masking = f"documents of geometric length, mean {doc_len:,.0f} tokens" if data.document_masking else (
        "one segment per window (no document masking)")  # fmt: skip
    return PlanBatches(FakeData(fake, 0, dp_size).next_step(), f"stated: {masking}")


def plan_batches(
    config: TrainConfig, tokenizer: TokenizerInfo | None, dp_size: int, doc_len: float | None
) -> PlanBatches:
    """The run's first step for data-parallel rank 0 when its data can be read with `tokenizer` (and `doc_len` is
    not given), else the stated distribution (the reason is in `source`)."""
    data = config.data
    if doc_len is not None:
        return stated_batches(config, dp_size, doc_len)
    if data.type == "fake":
        return PlanBatches(FakeData(data, 0, dp_size).next_step(), "the run's fake data (first step)")
    if tokenizer is None:
        stated = stated_batches(config, dp_size, DEFAULT_DOC_LEN)
        stated.source += " (the run's tokenizer is not at hand to read its data)"
        return stated
    try:
        source = build_step_data(data, 0, dp_size, tokenizer)
        return PlanBatches(source.next_step(), f"the run's data, first step ({', '.join(data.paths)})")
    except (*DataError, OSError) as e:
        stated = stated_batches(config, dp_size, DEFAULT_DOC_LEN)
        stated.source += f" (the run's data could not be read: {e})"
        return stated
