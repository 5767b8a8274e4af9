"""Attention sinks: one learned logit per head that joins every query's softmax denominator and adds nothing to its
output (gpt-oss). With sink s_h, head h weighs key j of query i by exp(x_ij) / (sum_j' exp(x_ij') + exp(s_h)), so
a query may give part of its attention to "nothing".

Two exact ways to compute it, whichever the kernel allows:

- from the log-sum-exp L_i = log sum_j exp(x_ij) a kernel returns with its output o_i: the normalizer exp(L_i)
  becomes exp(L_i) + exp(s_h), so the output is o_i * sigmoid(L_i - s_h) (`sink_scale`). Its backward needs the
  gradient through L, which a kernel either gives (flex attention) or lmforge writes (`cpu_attention`);
- plain masked attention with the sink as one more column of the scores (`masked_sink_attention`), for the paths
  without a log-sum-exp.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sink_scale(lse: Tensor, sinks: Tensor) -> Tensor:
    """sigmoid(lse - sink), in fp32 at least: the factor that turns attention without sinks into attention with
    them, for a log-sum-exp lse [..., H, T] and sinks [H]."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    return torch.sigmoid(lse.to(dtype) - sinks.to(dtype)[:, None])


def masked_sink_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, sinks: Tensor) -> Tensor:
    """Attention with sinks, written out: q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D] (query head h reads key/value
    head h // (Hq / Hkv)), allowed bool [Tq, Tk] (each query allows at least one key), sinks [Hq] -> [B, Hq, Tq, D].
    The scores and the softmax are fp32 at least; the output has v's dtype."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
