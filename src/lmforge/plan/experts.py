"""Expert parallelism in a plan: the exchange sizes of a dispatch depend on where the router sends tokens, which
fake tensors do not hold, so the plan sizes every exchange as perfectly balanced routing would."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmforge.parallel.experts import Exchange, ExpertDispatch, expert_modules


class BalancedDispatch(ExpertDispatch):
    """`ExpertDispatch` whose exchanges send every rank of the group an equal share of the copies (the remainder to
    the first ranks), and whose local experts each compute an equal share of what arrives: what the balancer aims
    at. No host read."""

    def sizes(self, counts: Tensor, rows: int) -> Exchange:
        """The balanced exchange of `rows` copies (every copy routed)."""
        ranks = self.shard.size
        send = [rows // ranks + (r < rows % ranks) for r in range(ranks)]
        local = counts.numel() // ranks
        received = rows  # each rank sends as many as it receives when every rank routes alike
        per_expert = [received // local + (e < received % local) for e in range(local)]
        order = torch.arange(received, device=counts.device)
        return Exchange(send, list(send), order, torch.tensor(per_expert, dtype=torch.int64, device=counts.device))


def balance_dispatches(model: nn.Module) -> int:
    """Size every expert-parallel dispatch of `model` as balanced routing would; returns how many were replaced."""
    replaced = 0
    for experts in expert_modules(model):
        if isinstance(experts.exchange, ExpertDispatch):
            experts.exchange = BalancedDispatch(experts.exchange.shard)
            replaced += 1
    return replaced
