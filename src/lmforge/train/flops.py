"""Parameter counts, training FLOPs and model FLOPs utilization (MFU).

Convention (one optimizer step, forward + backward):

    FLOPs = 6 x N_matmul x tokens  +  12 x layers x heads x head_dim x sum over segments of s (s + 1) / 2

N_matmul is the number of active non-embedding matrix parameters, the LM head included (a tied head still does its
matmul): every token multiplies each such weight once in forward (2 FLOPs per weight) and twice in backward. The
attention term counts the query-key pairs actually attended: with document masking a segment of s tokens attends
s (s + 1) / 2 pairs (causal), and each pair costs 2 x head_dim FLOPs for QK^T and as many for AV per head, times 3 for
forward + backward (with value heads narrower than the query/key heads, as MLA's, 2 x head_dim + 2 x value_dim: 12 x
head_dim above becomes 6 x (head_dim + value_dim)). A layer with a sliding window of w keys attends
w (w + 1) / 2 + (s - w) w pairs in a segment longer than w; the attention term then uses the mean over the layers.
`perf/mfu` uses this count; `perf/mfu_6nd` uses 6 x N_matmul x tokens alone (the PaLM-style approximation without
attention), for comparison with papers that report it.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lmforge.model.params import count_params

PEAK_BF16_FLOPS = {
    "B200": 2.25e15,
    "B100": 1.75e15,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
}
"""Dense bf16 tensor-core peak FLOP/s by device-name fragment (first match wins: specific names first)."""


def peak_flops(device: torch.device, name: str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device, or None: on the CPU (MFU means nothing there), and on a GPU that is
    not in the table, with one warning. `name` overrides the CUDA device name (for tests)."""
    if device.type != "cuda":
        return None
    name = name or torch.cuda.get_device_name(device)
    for fragment, peak in PEAK_BF16_FLOPS.items():
        if fragment in name:
            return peak
    warnings.warn(f"no peak FLOP/s known for {name!r}: perf/mfu is not logged", stacklevel=2)
    return None


def param_counts(model: nn.Module) -> dict[str, float]:
    """`params/total`, `params/embedding` (the token embedding), `params/non_embedding` and
    `params/active_non_embedding` (per token: routed experts count top_k / num_experts). Tied matrices count once.
    Global sizes, also under FSDP."""
    return count_params(model).metrics()


def attended_pairs(doc_lens: Iterable[torch.Tensor], window: int | None = None) -> int:
    """Query-key pairs one causal layer attends over the segments of some micro-batches (their CPU `doc_lens`):
    s (s + 1) / 2 per segment, or with a sliding window of w keys w (w + 1) / 2 + (s - w) w where s > w."""
    total = 0
    for lens in doc_lens:
        s = lens.to(torch.int64)
        if window is not None:
            s_in = s.clamp(max=window)
            total += int((s_in * (s_in + 1) // 2 + (s - s_in) * window).sum())
        else:
            total += int((s * (s + 1) // 2).sum())
    return total


class FlopCounter:
    """Training FLOPs of a step from its token count and attended pairs."""

    def __init__(
        self,
        model: nn.Module,
        layers: int,
        heads: int,
        head_dim: int,
        windows: Sequence[int | None] = (),
        value_dim: int | None = None,
    ) -> None:
        self.matmul = count_params(model).active_matmul
        # per head and attended pair: 2 x head_dim (q.k) + 2 x value_dim (p.v) forward, twice that backward
        self.per_pair = 6.0 * layers * heads * (head_dim + (head_dim if value_dim is None else value_dim))
        self.windows = Counter(windows or [None] * layers)
        """How many layers have each sliding window (None: full attention)."""

    def pairs(self, doc_lens: Sequence[torch.Tensor]) -> float:
        """The attended pairs of these micro-batches' segments, averaged over the layers (their windows differ)."""
        layers = sum(self.windows.values())
        return sum(n * attended_pairs(doc_lens, w) for w, n in self.windows.items()) / layers

    def step_flops(self, tokens: float, pairs: float) -> tuple[float, float]:
        """(FLOPs with attention, 6 x N x tokens) of a step."""
        dense = 6.0 * self.matmul * tokens
        return dense + self.per_pair * pairs, dense
