"""`data/source/<name>/tokens` and `data/source/<name>/share`: what a run has consumed of each source of a mixture.

The data worker counts each micro-batch's target tokens per source from the window positions and the pool's
document-to-source map (`lmforge.data.sources`); this callback adds the step's counts to the step's one SUM
all-reduce and keeps the running totals, which go into checkpoints so a resumed run continues them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lmforge.data.batch import MicroBatch
from lmforge.train.callbacks.base import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class SourceShares(Callback):
    """Tokens trained on per source since the start of the run, and each source's share of them."""

    name = "source_shares"

    def __init__(self, names: Sequence[str]) -> None:
        """`names`: the pool's sources, in the order of the micro-batches' `source_tokens`."""
        self.names = tuple(names)
        self.totals = np.zeros(len(self.names), dtype=np.int64)
        self._step = np.zeros(len(self.names), dtype=np.int64)

    def on_step_start(self, trainer: Trainer, micro_batches: Sequence[MicroBatch]) -> None:
        """Add up this rank's counts of the step (host tensors: no device work); a rank whose rows another rank
        counts (the other ranks of a TP or pipeline group) adds none."""
        self._step = np.zeros(len(self.names), dtype=np.int64)
        if not trainer.ctx.counts_rows:
            return
        for mb in micro_batches:
            if mb.source_tokens is not None:
                self._step += mb.source_tokens.numpy()

    def step_sums(self, trainer: Trainer) -> dict[str, Tensor]:
        """This rank's counts, summed over the ranks in the step's reduction."""
        return {"source_tokens": torch.from_numpy(self._step.astype(np.float64)).to(trainer.ctx.device)}

    def on_step_reduced(self, trainer: Trainer, sums: dict[str, Any]) -> dict[str, float]:
        """Running totals per source and their shares."""
        self.totals += np.rint(sums["source_tokens"]).astype(np.int64)
        total = max(int(self.totals.sum()), 1)
        metrics: dict[str, float] = {}
        for name, tokens in zip(self.names, self.totals.tolist(), strict=True):
            metrics[f"data/source/{name}/tokens"] = float(tokens)
            metrics[f"data/source/{name}/share"] = tokens / total
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The totals by source name."""
        return {"tokens": dict(zip(self.names, self.totals.tolist(), strict=True))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved totals (a source the checkpoint does not know starts at 0)."""
        saved = state["tokens"]
        self.totals = np.array([int(saved.get(name, 0)) for name in self.names], dtype=np.int64)
