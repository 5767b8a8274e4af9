"""`data.type = "fake"`: random tokens with random document lengths through the real micro-batch path.

Window w is drawn from a generator seeded by (data.seed, w), so every window is reproducible on its own and
the stream does not depend on the world size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmforge.config.data import FakeDataConfig
from lmforge.data.batch import MicroBatch, StepLayout, Window, pack_windows, segments_from_doc_starts


def fake_window(cfg: FakeDataConfig, index: int) -> Window:
    """Global window `index`: random tokens in documents of geometric length (mean cfg.mean_doc_len)."""
    rng = np.random.default_rng([cfg.seed, index])
    n = cfg.seq_len + 1
    # The window opens in the middle of a document; later documents start after geometric gaps.
    lengths = rng.geometric(1.0 / cfg.mean_doc_len, size=n // 2 + 2)
    starts = (np.cumsum(lengths) - rng.integers(0, lengths[0])).tolist()
    seg_lens = segments_from_doc_starts(starts, cfg.seq_len)
    if cfg.pattern == "uniform":
        tokens = rng.integers(0, cfg.vocab_size, size=n, dtype=np.int64)
    else:
        docs = segments_from_doc_starts(starts, n)
        tokens = np.concatenate([_counting(rng, cfg.vocab_size, length) for length in docs])
    return Window(tokens, seg_lens if cfg.document_masking else [cfg.seq_len])


def _counting(rng: np.random.Generator, vocab_size: int, length: int) -> np.ndarray:
    start, stride = rng.integers(0, vocab_size), rng.integers(1, 9)
    return (start + stride * np.arange(length, dtype=np.int64)) % vocab_size


class FakeData:
    """Endless fake windows dealt to ranks by the global window counter."""

    def __init__(self, cfg: FakeDataConfig, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.layout = StepLayout.from_tokens(cfg.seq_len, cfg.batch_tokens, cfg.micro_batch_tokens, rank, world_size)
        self.windows_done = 0

    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next step."""
        mine = self.layout.rank_windows(self.windows_done)
        self.windows_done += self.layout.windows_per_step
        return [pack_windows([fake_window(self.cfg, i) for i in chunk]) for chunk in self.layout.split(mine)]

    def state_dict(self) -> dict[str, Any]:
        """The global window counter."""
        return {"windows": self.windows_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after `state["windows"]` global windows."""
        self.windows_done = int(state["windows"])

    @property
    def epoch(self) -> float:
        """Fake data has no epochs."""
        return 0.0
