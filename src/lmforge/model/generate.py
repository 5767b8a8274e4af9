"""Autoregressive generation for `CausalLM`: a preallocated KV cache, sampling and streamed detokenization.

The cached forward reuses the model's own modules (embedding, norms, `Attention.qkv`, MLP, hyper-connections,
LM head), so it computes the same function as the training forward on a single document; only attention differs,
reading past keys and values from the cache instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from lmforge.model.hyper_connections import HyperConnection, collapse_stream, expand_stream, stream_rate
from lmforge.model.llama import CausalLM, DecoderLayer
from lmforge.model.masks import window_allows
from lmforge.model.rotary import rotary_cos_sin
from lmforge.model.sinks import masked_sink_attention


class KVCache:
    """Per-layer key/value buffers of one sequence, preallocated for `max_len` tokens.

    Buffers are laid out [Hkv, max_len, D], so the filled prefix is directly the [heads, time, dim] view that
    SDPA consumes, without a transpose or copy per decode step.
    """

    def __init__(
        self,
        model: CausalLM,
        max_len: int,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if max_len <= 0:
            raise ValueError(f"max_len {max_len}: a KV cache must hold at least one token")
        weight = model.model.embed_tokens.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        arch = model.arch
        keys, values = (arch.kv_heads, max_len, arch.dim_per_head), (arch.kv_heads, max_len, arch.value_head_dim)
        self.keys = [torch.zeros(keys, device=device, dtype=dtype) for _ in range(arch.num_hidden_layers)]
        self.values = [torch.zeros(values, device=device, dtype=dtype) for _ in range(arch.num_hidden_layers)]
        self.max_len = max_len
        self.length = 0
        """Number of positions already cached; the next token goes to this position."""

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k and v [T, Hkv, D] of the new tokens at positions `length..`; return all keys and values so far.

        The returned views are [Hkv, length + T, D]. `length` itself moves only in `advance`, once every
        layer has written, so all layers of one forward see the same starting position.
        """
        end = self.length + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens do not fit in max_len {self.max_len}")
        self.keys[layer][:, self.length : end] = k.transpose(0, 1)
        self.values[layer][:, self.length : end] = v.transpose(0, 1)
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, n: int) -> None:
        """Mark `n` more positions as filled."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length + n} tokens do not fit in max_len {self.max_len}")
        self.length += n


def _attend(q: Tensor, keys: Tensor, values: Tensor, start: int, window: int | None,
            sinks: Tensor | None = None) -> Tensor:  # fmt: skip
    """q [T, Hq, D] at positions start.., keys/values [Hkv, L, D] -> [T, Hq, D], causal over absolute positions
    and, with a sliding window, over the `window` positions ending at each query; with sinks [Hq], each head's sink
    logit joins every softmax."""
    t, num_heads, _ = q.shape
    groups = num_heads // keys.shape[0]
    if groups > 1:
        # Query head h reads kv head h // groups, as in HF's repeat_kv.
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
    mask = None
    if t > 1 or (window is not None and keys.shape[1] > window):
        # A single new token may see every cached key (unless a window cuts the oldest); a block of them must not
        # see the ones after itself.
        key_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
        query_pos = torch.arange(start, start + t, device=q.device)[:, None]
        mask = (key_pos <= query_pos) & window_allows(query_pos, key_pos, window)
    if sinks is not None:
        allowed = mask if mask is not None else torch.ones(t, keys.shape[1], dtype=torch.bool, device=q.device)
        out = masked_sink_attention(q.transpose(0, 1)[None], keys[None], values[None], allowed, sinks)
        return out[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask)
    return out[0].transpose(0, 1)


@torch.no_grad()
def forward_with_cache(model: CausalLM, input_ids: Tensor, cache: KVCache) -> Tensor:
    """Run new tokens input_ids [T] at positions `cache.length..` and return their logits [T, vocab].

    Their keys and values are appended to `cache`, which then advances by T. Works for a prompt prefill
    (T > 1) as well as for one decode step (T = 1).
    """
    if input_ids.ndim != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}")
    t = input_ids.shape[0]
    start = cache.length
    if start + t > cache.max_len:
        raise ValueError(
            f"KV cache overflow: {start} cached + {t} new tokens exceed max_len {cache.max_len}; "
            "allocate a larger cache"
        )
    decoder = model.model
    arch = model.arch
    x = decoder.embed_tokens(input_ids)
    positions = torch.arange(start, start + t, device=x.device)
    cos, sin = rotary_cos_sin(positions, arch, x.dtype)
    rate = stream_rate(arch)
    if rate:
        x = expand_stream(x, rate)
    for i, layer in enumerate(decoder.layers):

        def attend(h: Tensor, i: int = i, layer: DecoderLayer = layer) -> Tensor:
            attn = layer.self_attn
            normed = layer.input_layernorm(h)
            q, k, v = attn.qkv(normed, cos, sin)
            keys, values = cache.write(i, k, v)
            out = _attend(q, keys, values, start, attn.window, attn.sinks)
            return attn.output(out.reshape(t, attn.num_heads, -1), normed, v)

        def mlp(h: Tensor, layer: DecoderLayer = layer) -> Tensor:
            return layer.mlp(layer.post_attention_layernorm(h))

        x = _residual(layer.attn_hc, x, attend)
        x = _residual(layer.mlp_hc, x, mlp)
    if rate:
        x = collapse_stream(x)
    cache.advance(t)
    return model.lm_head(decoder.norm(x))


def _residual(hc: HyperConnection | None, x: Tensor, branch: Callable[[Tensor], Tensor]) -> Tensor:
    """One sub-layer on the residual stream: x + branch(x), or through its hyper-connection."""
    return x + branch(x) if hc is None else hc(x, branch)


def sample_next(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Pick the next token id from logits [V].

    temperature <= 0 is greedy argmax. Otherwise tokens are drawn from softmax(logits / temperature),
    restricted to the nucleus: in order of decreasing probability, a token is kept when the mass of the
    tokens before it is still below `top_p`. That is the smallest set of most likely tokens whose mass
    reaches top_p, and it always holds the most likely token. top_p = 1 keeps every token.
    """
    logits = logits.float()
    if temperature <= 0:
        return int(torch.argmax(logits))
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p {top_p}: must be in (0, 1]")
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep = mass_before < top_p
        keep[0] = True
        nucleus = torch.zeros_like(probs)
        nucleus[order[keep]] = sorted_probs[keep]
        probs = nucleus
    # multinomial renormalizes, so the nucleus needs no explicit division by its mass.
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(
    model: CausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | Collection[int] | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` generated ids, one at a time, continuing `prompt_ids`.

    Stops after `eos_id` (one id or several; the one generated is yielded), after `max_new_tokens`, or when the
    sequence reaches the model's `max_position_embeddings`. The same seed gives the same tokens. Arguments are
    checked here, before the first token is asked for.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: generation needs at least one token to continue")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens {max_new_tokens}: must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p {top_p}: must be in (0, 1]")
    bad = [i for i in prompt_ids if not 0 <= i < model.vocab_size]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {model.vocab_size})")
    limit = model.arch.max_position_embeddings
    if len(prompt_ids) > limit:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than max_position_embeddings {limit}")
    budget = min(max_new_tokens, limit - len(prompt_ids))
    stop = frozenset(() if eos_id is None else (eos_id,) if isinstance(eos_id, int) else eos_id)
    return _generate(model, prompt_ids, budget, temperature, top_p, seed, stop)


def _generate(
    model: CausalLM,
    prompt_ids: list[int],
    budget: int,
    temperature: float,
    top_p: float,
    seed: int,
    stop: frozenset[int],
) -> Iterator[int]:
    if budget == 0:
        return
    device = model.model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    # The last generated token is never fed back, so the cache needs one slot less than the final length.
    cache = KVCache(model, len(prompt_ids) + budget - 1)
    logits = forward_with_cache(model, torch.tensor(prompt_ids, dtype=torch.long, device=device), cache)[-1]
    for n in range(budget):
        token = sample_next(logits, temperature, top_p, generator)
        yield token
        if token in stop or n == budget - 1:
            return
        logits = forward_with_cache(model, torch.tensor([token], dtype=torch.long, device=device), cache)[-1]


class TextStream:
    """Turn generated token ids into printable text, piece by piece.

    Each `push` decodes the whole list of ids so far and returns the part beyond what was already returned.
    A token can end in the middle of a multi-byte character; while the decoded text ends in U+FFFD, the
    text is held back until later tokens complete the character (or `flush` gives up on it).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._returned = 0

    def _take_new(self, text: str) -> str:
        new = text[self._returned :]
        self._returned = len(text)
        return new

    def push(self, token_id: int) -> str:
        """Add one generated id and return the text it makes printable (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        return self._take_new(text)

    def flush(self) -> str:
        """Return whatever has not been returned yet, incomplete characters included."""
        return self._take_new(self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens))
