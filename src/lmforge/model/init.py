"""From-scratch weight init whose values depend only on the seed and the parameter names.

Each parameter draws from its own generator, seeded from (seed, canonical parameter name), so the values do
not depend on the order of construction, the world size or how parameters are later sharded.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a stable hash of (seed, canonical name)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_role(name: str, param: torch.Tensor) -> str:
    """How a parameter is initialized: `normal` (matrices, embeddings), `one` (norm scales) or `zero` (biases)."""
    if name.endswith(".bias"):
        return "zero"
    if param.ndim >= 2:
        return "normal"
    leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
    if leaf.endswith("norm") and name.endswith(".weight"):
        return "one"
    raise ValueError(
        f"no init rule for 1-D parameter {name!r}: only norm weights and biases are known; give its module an init rule"
    )


@torch.no_grad()
def init_weights(model: nn.Module, std: float, seed: int) -> None:
    """Initialize every parameter of an unsharded model: N(0, std) for matrices, 1 for norms, 0 for biases."""
    for name, param in model.named_parameters():
        role = init_role(name, param)
        if role == "one":
            param.fill_(1.0)
        elif role == "zero":
            param.zero_()
        else:
            gen = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(values)
