"""Multi-token prediction (DeepSeek-V3's MTP modules), as transformers' `MtpLayer` computes them.

Module k (k = 1..D) predicts, at position t, the token t + k + 1. It reads the previous depth's hidden state at t
(for k = 1 the main model's final, normed hidden state) and the embedding of token t + k:

    h_k(t) = norm_k(block_k(eh_proj([enorm(embed(x[t + k])), hnorm(h_{k-1}(t))])))
    logits_k(t) = lm_head(h_k(t))

with the shared embedding and LM head, `block_k` a decoder block of its own (an MoE block in DeepSeek-V3) that
attends within documents like every block, and `norm_k` its `shared_head.norm`. In checkpoints the modules are
decoder layers num_hidden_layers + k - 1 (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and the block's own
tensors); the module class is `lmforge.model.llama.MtpLayer`.

A position has a depth-k target only where its k-th future token is a loss target in the same document: the token
t + k + 1 lies in t's document, inside the row, and the main loss counts position t + k (`mtp_targets`). Positions
near a document's end therefore have fewer depths; no target ever reaches into the next document.

The MTP loss enters training through its gradient (`lmforge.model.aux_loss`): the forward returns the main loss
unchanged, so `loss/mean` and every statistic built on it stay the main model's, and backward gives each depth's
summed loss the gradient `scale[k]` = mtp_weight / D / (the step's depth-k target count over all ranks), which
`lmforge.train.callbacks.mtp` sets before each step. The objective is therefore main mean + mtp_weight / D x the
sum over k of depth k's mean loss, DeepSeek-V3's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmforge.model.loss import IGNORE_INDEX
from lmforge.model.norm import RMSNorm


class SharedHead(nn.Module):
    """The norm before the shared LM head (`shared_head.norm` in DeepSeek's checkpoints)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


def mtp_targets(input_ids: Tensor, targets: Tensor, doc_ids: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """Depth `depth`'s inputs and targets [T] for a row's input_ids, targets (IGNORE_INDEX where the main loss
    has none) and per-position document ids [T]: the token t + depth, and the target of position t + depth where
    token t + depth + 1 is inside the row and in t's document, else IGNORE_INDEX. On the device, no host read."""
    t = input_ids.shape[0]
    pos = torch.arange(t, device=input_ids.device)
    ahead = (pos + depth).clamp(max=t - 1)
    after = (pos + depth + 1).clamp(max=t - 1)
    valid = (pos + depth + 1 < t) & (doc_ids[after] == doc_ids)
    return input_ids[ahead], torch.where(valid, targets[ahead], IGNORE_INDEX)
