"""The shapes every attention path shares: which keys a sliding window keeps, the causal band of one segment (as
booleans or as an additive mask), and value heads padded to the query/key width for kernels that take one head
dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def window_allows(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor | bool:
    """Whether key row position k_pos is within the sliding window of query row position q_pos (broadcast; True
    without a window). Together with "same segment, not after the query" it is the windowed document mask."""
    return True if window is None else (q_pos - k_pos) < window


def causal_band(length: int, window: int | None, device: torch.device) -> Tensor:
    """Boolean [length, length]: query i of one segment may attend key j (j <= i, and i - j < window with one)."""
    pos = torch.arange(length, device=device)
    return (pos[:, None] >= pos[None, :]) & window_allows(pos[:, None], pos[None, :], window)


def band_bias(length: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`causal_band` as an additive mask: 0 where a key is attended, -inf elsewhere (the form the CPU flash kernel
    takes)."""
    allowed = causal_band(length, window, device)
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def padded_values(v: Tensor, qk_dim: int) -> Tensor:
    """v [..., Dv] with zero channels up to the query/key head dim, for the kernels that take one head dim for q, k
    and v (the CPU flash kernel, the varlen kernels). The extra output channels are zero and are cut off after the
    call; their gradients never reach v. Multi-head latent attention's value heads are narrower than its query/key
    heads; wider value heads would change the kernel's softmax scale, and are refused."""
    if v.shape[-1] > qk_dim:
        raise ValueError(f"value heads of {v.shape[-1]} channels are wider than the {qk_dim} of queries and keys")
    return v if v.shape[-1] == qk_dim else F.pad(v, (0, qk_dim - v.shape[-1]))
