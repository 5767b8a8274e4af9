"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with transformers' parameter names.

Queries come from `q_proj`, or through a low-rank path `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`. Keys and values
come from one compressed latent: `kv_a_proj_with_mqa` gives the latent (kv_lora_rank wide) and a RoPE key part
shared by every head; the latent goes through `kv_a_layernorm` and `kv_b_proj` into each head's no-position key part
and its value. A query/key head is [no-position part, RoPE part] (qk_nope_head_dim + qk_rope_head_dim channels), a
value head v_head_dim channels, usually narrower: every attention backend takes narrower values
(`lmforge.model.masks.padded_values`).

With `rope_interleave` (DeepSeek's layout) the RoPE channels pair up as (0, 1), (2, 3), ...; they are reordered into
two halves before lmforge's half-split rotation, the same reordering for queries and keys, so the scores are those
of the interleaved rotation. YaRN's `mscale_all_dim` scales every channel's logits by mscale^2: the queries are
multiplied by it, which the softmax cannot tell from a scaled score.

The keys and values are expanded per head before attention (as transformers does in training): the latent is what an
inference engine would cache, and `lmforge sample`'s cache keeps the expanded heads instead, which is exact.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lmforge.config.arch_deepseek import DeepseekV3Arch
from lmforge.model.attention import AttentionFn, DocumentMask
from lmforge.model.norm import RMSNorm
from lmforge.model.rotary import apply_rotary


def pairs_to_halves(x: Tensor) -> Tensor:
    """Channels in interleaved pairs (x0, x1, x2, x3, ...) -> the even ones, then the odd ones."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention: the interface of `lmforge.model.llama.Attention` (`qkv`, `output`, `forward`,
    `window`, `sinks`), with keys [T, H, nope + rope] and values [T, H, v_head_dim]."""

    def __init__(self, arch: DeepseekV3Arch, attention: AttentionFn, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        """Sliding window (None: full causal attention; DeepSeek-V3 has none)."""
        self.sinks: Tensor | None = None
        self.num_heads = self.num_kv_heads = arch.num_attention_heads
        self.head_dim = arch.dim_per_head
        """Width of one query/key head."""
        self.value_dim = arch.v_head_dim
        self.nope, self.rope = arch.qk_nope_head_dim, arch.qk_rope_head_dim
        self.kv_lora_rank = arch.kv_lora_rank
        hidden, heads, bias, eps = arch.hidden_size, self.num_heads, arch.attention_bias, arch.rms_norm_eps
        if arch.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, arch.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(arch.q_lora_rank, heads * self.head_dim, bias=False)
        self.low_rank_q = arch.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope + self.value_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.value_dim, hidden, bias=bias)
        self.interleave = arch.rope_interleave
        self.q_scale = arch.softmax_scale * math.sqrt(self.head_dim)
        """Factor on the queries that makes the backends' 1 / sqrt(head_dim) the architecture's softmax scale."""
        self.attention = attention

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] -> q and k [T, H, nope + rope] with RoPE on their trailing channels, v [T, H, v_head_dim].
        Shared by the training forward and the KV-cached inference path."""
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q_nope, q_rot = q.view(t, self.num_heads, self.head_dim).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, self.num_heads, self.nope + self.value_dim)
        k_nope, v = kv.split([self.nope, self.value_dim], dim=-1)
        k_rot = k_rot.view(t, 1, self.rope)
        if self.interleave:
            q_rot, k_rot = pairs_to_halves(q_rot), pairs_to_halves(k_rot)
        q = torch.cat((q_nope, apply_rotary(q_rot, cos, sin)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat((k_nope, apply_rotary(k_rot, cos, sin).expand(t, self.num_heads, self.rope)), dim=-1)
        return q, k, v

    def output(self, out: Tensor, x: Tensor, v: Tensor) -> Tensor:
        """The heads' outputs out [T, H, v_head_dim] -> o_proj's result."""
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.value_dim))

    def local_sinks(self) -> Tensor | None:
        """MLA has no sinks."""
        return None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = self.qkv(x, cos, sin)
        out = self.attention(q, k, v, mask, self.window)
        return self.output(out.reshape(x.shape[0], self.num_heads, self.value_dim), x, v)
