"""A hand-written PyTorch training loop for a Llama: what a user who does not take a trainer writes instead.

It is the baseline lmforge is measured against (`overhead.py`, `peers.py`), so it shares none of lmforge's code:
only torch. The model is the Llama lmforge trains (RMSNorm, RoPE in the half-split layout, grouped-query
attention, SwiGLU MLP, an untied or tied LM head), with the same parameter names, so that a caller can copy the
weights of an lmforge model into it (`load_state_dict`) and start both loops from the same point.

Attention is `F.scaled_dot_product_attention(..., is_causal=True)`, the fused causal kernel:

- a batch of whole windows ([B, T], no `seq_lens`) is one call;
- a packed row with document masking ([1, T] and its `seq_lens`) is one call per segment, so that no token sees
  the document before its own.

`compile=True` wraps the whole model in `torch.compile`, as most users (nanoGPT, litgpt) do. The per-segment loop
is kept out of the compiled graph (`torch.compiler.disable`): its trip count and slice sizes change with every
micro-batch, and compiling it would recompile for every new layout. Rows without `seq_lens` compile whole.

A step is forward -> `F.cross_entropy(reduction="sum") / step tokens` -> backward per micro-batch, then
`clip_grad_norm_`, `AdamW.step` (foreach) and `zero_grad`, and one host read of the step's loss.

Run alone, it trains on random tokens and prints each step's time. `peers.py` runs it like this, with the initial
weights (`--init`, a safetensors file of HF Llama tensor names) and the token windows (`--windows`, a .npy of
[windows, seq_len + 1] token ids, taken in order, `--batch` per step) that every side of its comparison shares:

    .venv/bin/python benchmarks/plain_loop.py --steps 12 [--compile] [--batch 8] [--seq-len 512] [--json PATH]
                                              [--init WEIGHTS.safetensors] [--windows WINDOWS.npy]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LlamaShape:
    """The architecture: the fields of an HF `LlamaConfig` that the training loop needs."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 8192
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class OptimSettings:
    """AdamW with decoupled weight decay on matrices and embeddings, and gradient clipping."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_norm: float = 1.0


@dataclass
class Batch:
    """One micro-batch: token ids and next-token targets [B, T]; for a packed row (B = 1) with document masking,
    each token's position in its document [1, T] and the segment lengths (int tensor [S], adding up to T)."""

    input_ids: Tensor
    target_ids: Tensor
    position_ids: Tensor | None = None
    seq_lens: Tensor | None = None


# ---------------------------------------------------------------------------------------------- the model


def rope_tables(shape: LlamaShape) -> tuple[Tensor, Tensor]:
    """cos and sin [max_seq_len, head_dim] of every position, fp32: the two halves of a head rotate as pairs
    (channel i with channel i + head_dim / 2), the layout of HF Llama checkpoints."""
    d = shape.head_dim
    inv_freq = shape.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(shape.max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE: x [B, T, heads, head_dim] rotated by the tables of its positions [B, T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    turned = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(2) + turned * sin.unsqueeze(2)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] -> [B, Hq, T, D]: the fused causal kernel, one call."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@torch.compiler.disable
def document_attention(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor) -> Tensor:
    """Causal attention inside each segment of a packed row (q, k, v [1, heads, T, D]): one fused causal call per
    segment. Kept out of `torch.compile`: the segments change with every micro-batch."""
    lens = seq_lens.tolist()
    if len(lens) == 1:
        return causal_attention(q, k, v)
    parts = zip(q.split(lens, dim=2), k.split(lens, dim=2), v.split(lens, dim=2), strict=True)
    return torch.cat([causal_attention(qs, ks, vs) for qs, ks, vs in parts], dim=2)


class SelfAttention(nn.Module):
    """Grouped-query self-attention with RoPE on queries and keys."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(width, shape.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: Tensor | None) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q = rotate(self.q_proj(x).view(b, t, self.heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = causal_attention(q, k, v) if seq_lens is None else document_attention(q, k, v, seq_lens)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """The Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: attention, then the MLP, each on a residual branch."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(shape.hidden_size, eps=shape.norm_eps)
        self.self_attn = SelfAttention(shape)
        self.post_attention_layernorm = nn.RMSNorm(shape.hidden_size, eps=shape.norm_eps)
        self.mlp = SwiGLU(shape)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: Tensor | None) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, blocks and final norm (HF's `model.` prefix, so that the parameter names match)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.norm = nn.RMSNorm(shape.hidden_size, eps=shape.norm_eps)


class Llama(nn.Module):
    """The decoder and its LM head."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.model = Decoder(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(shape)
        # Not in the state dict: derived from the shape, and a copied lmforge state dict has no such entries.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, seq_lens: Tensor | None = None) -> Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]. Without `position_ids` every row starts at position 0; with
        `seq_lens` (B = 1), attention stays inside each segment."""
        if position_ids is None:
            cos, sin = self.cos[: input_ids.shape[1]], self.sin[: input_ids.shape[1]]
            cos, sin = cos.expand(input_ids.shape[0], -1, -1), sin.expand(input_ids.shape[0], -1, -1)
        else:
            cos, sin = self.cos[position_ids], self.sin[position_ids]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, seq_lens)
        return self.lm_head(self.model.norm(x))


def init_normal(model: nn.Module, std: float, seed: int) -> None:
    """A from-scratch init: normal(0, std) matrices and embeddings (norm scales stay at one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std, generator=gen)


# ---------------------------------------------------------------------------------------------- the loop


class PlainTrainer:
    """The model, its AdamW and the step: all that a hand-written loop holds."""

    def __init__(
        self,
        shape: LlamaShape,
        optim: OptimSettings,
        compile: bool = False,
        state_dict: dict[str, Tensor] | None = None,
        init_std: float = 0.02,
        seed: int = 0,
    ) -> None:
        """Build the model (weights from `state_dict`, else a normal init), AdamW, and with `compile`, wrap the
        model in `torch.compile` (compiled at the first step)."""
        self.model = Llama(shape)
        if state_dict is not None:
            self.model.load_state_dict(state_dict)
        else:
            init_normal(self.model, init_std, seed)
        params = list(self.model.parameters())
        # nanoGPT's groups: matrices and embeddings decay, norm scales do not.
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=True
        )
        self.max_norm = optim.max_norm
        self.forward = torch.compile(self.model) if compile else self.model

    def step(self, micro_batches: Sequence[Batch]) -> float:
        """One optimizer step over `micro_batches`; returns the mean loss per target token."""
        n_tokens = sum(mb.target_ids.numel() for mb in micro_batches)
        loss_sum = torch.zeros(())
        for mb in micro_batches:
            logits = self.forward(mb.input_ids, mb.position_ids, mb.seq_lens)
            loss = F.cross_entropy(logits.flatten(0, 1), mb.target_ids.flatten(), reduction="sum")
            (loss / n_tokens).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum) / n_tokens


def random_batch(gen: torch.Generator, batch: int, seq_len: int, vocab_size: int) -> Batch:
    """`batch` windows of uniform random tokens, no document masking."""
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    return Batch(tokens[:, :-1], tokens[:, 1:])


def window_batch(windows: Tensor, step: int, batch: int) -> Batch:
    """Step `step`'s (from 0) `batch` windows of `windows` [N, seq_len + 1], taken in order (from the start again
    after the last), no document masking."""
    rows = torch.arange(step * batch, (step + 1) * batch) % windows.shape[0]
    tokens = windows[rows]
    return Batch(tokens[:, :-1], tokens[:, 1:])


def load_weights(path: Path) -> dict[str, Tensor]:
    """A state dict of the model from a safetensors file with its (HF Llama) tensor names."""
    from safetensors.torch import load_file

    return load_file(path)


# ---------------------------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of a standalone run."""
    shape, optim = LlamaShape(), OptimSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in {**asdict(shape), **asdict(optim)}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true", help=f"(default {value})")
        else:
            p.add_argument(flag, type=type(value), default=value, help=f"(default {value})")
    p.add_argument("--batch", type=int, default=8, help="windows per step, in one micro-batch (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: --max-seq-len)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps, all timed (default 12)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--json", type=Path, default=None, help="write each step's seconds and loss to this file")
    p.add_argument("--init", type=Path, default=None, help="start from these weights (safetensors, HF Llama names)")
    p.add_argument(
        "--windows", type=Path, default=None,
        help="train on these token windows (.npy [N, seq_len + 1], in order) instead of random tokens",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train on random tokens (or the given windows), print a line per step and optionally write the step times."""
    args = parse_args(argv)
    shape = LlamaShape(**{k: getattr(args, k) for k in asdict(LlamaShape())})
    optim = OptimSettings(**{k: getattr(args, k) for k in asdict(OptimSettings())})
    seq_len = args.seq_len or shape.max_seq_len
    weights = load_weights(args.init) if args.init is not None else None
    trainer = PlainTrainer(shape, optim, compile=args.compile, state_dict=weights, seed=args.seed)
    windows = torch.from_numpy(np.load(args.windows)).long() if args.windows is not None else None
    if windows is not None and windows.shape[1] != seq_len + 1:
        raise SystemExit(f"plain_loop.py: --windows has rows of {windows.shape[1]} tokens, not seq_len + 1")
    gen = torch.Generator().manual_seed(args.seed)
    tokens = args.batch * seq_len
    seconds: list[float] = []
    losses: list[float] = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        if windows is None:
            batch = random_batch(gen, args.batch, seq_len, shape.vocab_size)
        else:
            batch = window_batch(windows, step - 1, args.batch)
        loss = trainer.step([batch])
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
        print(f"step {step} loss {loss:.4f} time {seconds[-1]:.4f} s tokens/s {tokens / seconds[-1]:.1f}", flush=True)
    if args.json is not None:
        params = sum(p.numel() for p in trainer.model.parameters())
        figures: dict[str, Any] = {"tokens_per_step": tokens, "step_seconds": seconds, "losses": losses,
                                   "params": params}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if all(math.isfinite(x) for x in losses) else 1


if __name__ == "__main__":
    sys.exit(main())
