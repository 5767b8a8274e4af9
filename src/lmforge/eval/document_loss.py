"""Each document's loss in a replayed step (`lmforge replay --score`): the step's micro-batches scored with a
checkpoint's weights, and every loss target's cross-entropy added to the document it belongs to.

The model gives each position's fp32 cross-entropy (`CausalLM.forward(..., per_token=True)`, the LM head and softmax
as in training); token t > 0 of a row is the target of micro-batch position `row.offset + t - 1`, and a document owns
the targets that are its own tokens (`lmforge.data.replay`), so the documents' sums add up to the step's loss sum.
Scored with the checkpoint of the step before, they equal the logged `loss/mean` x `loss/tokens` up to fp32
reduction order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lmforge.data.replay import Piece, ReplayedBatch
from lmforge.model.loss import IGNORE_INDEX


@dataclass(frozen=True)
class DocumentLoss:
    """One document part's loss in a step."""

    batch: int
    """Its micro-batch's global index in the step."""
    piece: Piece
    """The part (where it comes from, its tokens)."""
    loss_sum: float
    """Summed cross-entropy (nats) over its loss targets."""

    @property
    def loss_mean(self) -> float:
        """Mean cross-entropy per loss target (NaN without targets)."""
        return self.loss_sum / self.piece.loss_tokens if self.piece.loss_tokens else float("nan")


@torch.no_grad()
def score_documents(model: nn.Module, batches: Sequence[ReplayedBatch], device: torch.device) -> list[DocumentLoss]:
    """The loss of every document part of `batches`, in order (see the module docstring)."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for b in batches:
            mb = b.batch.to(device)
            targets = mb.target_ids.masked_fill(~mb.loss_mask, IGNORE_INDEX)
            ce = model(mb.input_ids, mb.position_ids, mb.doc_lens, targets=targets, per_token=True)
            ce = ce.double().cpu().numpy()
            for row in b.rows:
                for p in row.pieces:
                    # Token t (> 0) of the row is the target of position offset + t - 1.
                    at = row.offset + p.start + np.flatnonzero(p.loss) - 1
                    out.append(DocumentLoss(b.index, p, float(ce[at].sum())))
    finally:
        model.train(was_training)
    return out
