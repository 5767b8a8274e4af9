"""The SwiGLU feed-forward block: the dense MLP of a decoder layer and the shared experts of an MoE block."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class MLP(nn.Module):
    """SwiGLU feed-forward block (HF's `gate_proj` / `up_proj` / `down_proj`)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
