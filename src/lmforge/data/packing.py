"""Variable-length samples packed into micro-batches of a fixed number of positions.

Samples are taken in stream order and each becomes one segment, so attention, positions and the loss never cross
from one sample into another. A sample that does not fit in what is left of the current micro-batch is carried
whole into the next one, and the gap is filled by one unscored padding segment: every micro-batch has exactly
`capacity` positions (one shape for compiled code) and no sample is split from its own context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from lmforge.data.batch import MicroBatch, Window, pack_windows, padding_window


def fill_bins(lengths: Iterable[int], capacity: int, count: int | None = None) -> list[list[int]]:
    """Greedy in-order packing: indices (into `lengths`) of the samples of each micro-batch.

    `lengths` are positions per sample (tokens - 1), each at most `capacity`. Stops once `count` micro-batches are
    closed (a micro-batch closes when the next sample does not fit, and that sample is not part of the result) or
    when the lengths run out, whose last, partly filled micro-batch is included. `count=None` packs everything.
    """
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sample {i} has {n} positions, more than a micro-batch's {capacity}")
        if used + n > capacity:
            bins.append(current)
            if count is not None and len(bins) == count:
                return bins
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        bins.append(current)
    return bins


def sample_window(ids: np.ndarray, loss: np.ndarray) -> Window:
    """One sample as one segment: inputs ids[:-1], targets ids[1:], scored where the target is a loss token."""
    return Window(ids.astype(np.int64), [len(ids) - 1], loss[1:])


def pack_samples(samples: Sequence[tuple[np.ndarray, np.ndarray]], capacity: int) -> MicroBatch:
    """(ids, loss) samples that fit in `capacity` positions as one micro-batch, padded to exactly `capacity`."""
    windows = [sample_window(ids, loss) for ids, loss in samples]
    used = sum(len(ids) - 1 for ids, _ in samples)
    if used > capacity:
        raise ValueError(f"samples of {used} positions do not fit in a micro-batch of {capacity}")
    if used < capacity:
        windows.append(padding_window(capacity - used))
    return pack_windows(windows)
