"""The gated feed-forward block: the dense MLP of a decoder layer and the shared experts of an MoE block."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.config.arch_base import MlpAct


class MLP(nn.Module):
    """Gated feed-forward block (HF's `gate_proj` / `up_proj` / `down_proj`): down(act(gate(x)) x up(x)), with act
    SiLU (SwiGLU, the default) or ReLU squared (`relu2`: relu(g)^2, from Primer, So et al., "Primer: Searching for
    Efficient Transformers for Language Modeling", arXiv 2109.08668), each as transformers' `ACT2FN[hidden_act]`
    computes it."""

    def __init__(self, hidden: int, intermediate: int, act: MlpAct = "silu") -> None:
        super().__init__()
        if act not in ("silu", "relu2"):
            raise ValueError(f"MLP activation {act!r} is not one of 'silu', 'relu2'")
        self.act = act
        """The gate half's activation, as config.json's `hidden_act` names it."""
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate = self.gate_proj(x)
        # relu then square, in transformers' order, so an exported model's logits match bit for bit in fp32.
        act = F.silu(gate) if self.act == "silu" else F.relu(gate).square()
        return self.down_proj(act * self.up_proj(x))
