"""Hyper-connections (Zhu et al., "Hyper-Connections", arXiv 2409.19606): the residual stream widened to n copies.

The embedding output is copied into a stream H [n, T, hidden] (n: the expansion rate). Every sub-layer (attention,
then the MLP, each with a hyper-connection of its own) reads a weighted sum of the copies and writes its output back
into all of them; the copies are summed before the final norm. Per token, with H_t [n, hidden]:

    input   = A_m^T H_t                         (A_m [n]: one weight per copy)
    H_t'    = B^T branch(input) + A_r^T H_t     (B [n]: output weight per copy; A_r [n, n]: width-connection)

Static hyper-connections (SHC) learn A_m, A_r and B directly. Dynamic ones (DHC) add an input-dependent term per
token, from the normed copies H_bar = norm(H_t):

    A_m(H) = A_m + s_alpha tanh(H_bar W_m)      (W_m [hidden])
    A_r(H) = A_r + s_alpha tanh(H_bar W_r)      (W_r [hidden, n])
    B(H)   = B   + s_beta  tanh(H_bar W_beta)   (W_beta [hidden])

Init (the paper's): the k-th sub-layer of the network reads copy k mod n (A_m = e_{k mod n}), A_r = I, B = 1, the
dynamic matrices W are zero and the scales s_alpha, s_beta 0.01. Then every copy holds the plain pre-norm residual
stream at every depth, so the network equals the one without hyper-connections (the sum of the n equal copies
before the final RMSNorm changes only its epsilon's relative weight). The scales start at 0.01, not 0: with both
W and s at zero neither would ever get a gradient.

Here A_m and A_r are stored together as `static_alpha` [n, n + 1] (column 0: A_m, columns 1..n: A_r) and W_m, W_r
as `alpha_proj` [n + 1, hidden] (row 0: W_m, rows 1..n: W_r, the layout of `nn.Linear`), so one product gives all
of a token's input and width weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DYNAMIC_SCALE_INIT = 0.01
"""Initial value of the dynamic scales s_alpha and s_beta (the paper's)."""


def stream_rate(arch: object) -> int:
    """The expansion rate of an architecture's residual stream: its `hyper_connections` (0, no hyper-connections,
    for the families without the option)."""
    return int(getattr(arch, "hyper_connections", 0))


def expand_stream(x: Tensor, rate: int) -> Tensor:
    """The embedding output x [T, hidden] as the initial hyper-connection stream: n equal copies [n, T, hidden]."""
    return x.unsqueeze(0).expand(rate, *x.shape)


def collapse_stream(stream: Tensor) -> Tensor:
    """The stream [n, T, hidden] after the last block -> [T, hidden]: the sum of its copies (then the final norm)."""
    return stream.sum(0)


class HyperConnection(nn.Module):
    """The hyper-connection around one sub-layer (`branch`): reads the stream [n, T, hidden], runs the branch on
    the weighted sum of its copies and writes the result back (see the module docstring for the equations).

    `layer` is the sub-layer's index k among all sub-layers of the network (decoder block i: 2 i for attention,
    2 i + 1 for the MLP); it decides the init only. `norm` (the dynamic weights' input norm) makes it dynamic
    (DHC); None: static (SHC)."""

    def __init__(self, rate: int, hidden_size: int, layer: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        if rate < 1:
            raise ValueError(f"a hyper-connection needs an expansion rate of at least 1, got {rate}")
        self.rate = rate
        self.layer = layer
        self.dynamic = norm is not None
        self.static_alpha = nn.Parameter(torch.empty(rate, rate + 1))
        self.static_beta = nn.Parameter(torch.empty(rate))
        if norm is not None:
            self.norm = norm
            self.alpha_proj = nn.Parameter(torch.empty(rate + 1, hidden_size))
            self.beta_proj = nn.Parameter(torch.empty(hidden_size))
            # Shape [1], not a 0-d scalar: FSDP2 shards every parameter along dim 0.
            self.alpha_scale = nn.Parameter(torch.empty(1))
            self.beta_scale = nn.Parameter(torch.empty(1))

    @property
    def init_rules(self) -> dict[str, str]:
        """How `lmforge.model.init.init_weights` sets each parameter (`declared`: `init_value`); the norm's
        weight is a norm scale (1)."""
        rules = {"static_alpha": "declared", "static_beta": "one"}
        if self.dynamic:
            rules |= {"alpha_proj": "zero", "beta_proj": "zero", "alpha_scale": "declared", "beta_scale": "declared"}
        return rules

    def init_value(self, name: str) -> Tensor:
        """The paper's initial value (fp32, full shape) of the parameter `name` that `init_rules` declares."""
        if name == "static_alpha":
            value = torch.zeros(self.rate, self.rate + 1)
            value[self.layer % self.rate, 0] = 1.0
            value[:, 1:] = torch.eye(self.rate)
            return value
        if name in ("alpha_scale", "beta_scale"):
            return torch.full((1,), DYNAMIC_SCALE_INIT)
        raise KeyError(f"{name!r} has no declared init value")

    def weights(self, stream: Tensor) -> tuple[Tensor, Tensor]:
        """The connection weights for the stream [n, T, hidden]: alpha (column 0: A_m, columns 1..n: A_r) and
        beta (B), [n, n + 1] and [n] for static hyper-connections, per token [n, T, n + 1] and [n, T] for dynamic
        ones."""
        if not self.dynamic:
            return self.static_alpha, self.static_beta
        normed = self.norm(stream)
        alpha = self.static_alpha[:, None, :] + self.alpha_scale * torch.tanh(F.linear(normed, self.alpha_proj))
        beta = self.static_beta[:, None] + self.beta_scale * torch.tanh(normed @ self.beta_proj)
        return alpha, beta

    def forward(self, stream: Tensor, branch: Callable[[Tensor], Tensor]) -> Tensor:
        """stream [n, T, hidden] -> [n, T, hidden]: copy i becomes B_i branch(A_m^T H) + (A_r^T H)_i per token."""
        alpha, beta = self.weights(stream)
        alpha, beta = alpha.to(stream.dtype), beta.to(stream.dtype)
        if alpha.ndim == 2:
            mixed = torch.einsum("jc,jtd->ctd", alpha, stream)
            beta = beta[:, None, None]
        else:
            mixed = torch.einsum("jtc,jtd->ctd", alpha, stream)
            beta = beta[..., None]
        return beta * branch(mixed[0]) + mixed[1:]
