"""KV-cached generation: cached logits equal the training forward, greedy equals transformers, sampling rules."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lmforge.model import build_model
from lmforge.model.generate import KVCache, TextStream, forward_with_cache, generate, sample_next
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.prep.tokenizer_train import train_bpe
from tests.conftest import require, tiny_llama, tiny_qwen3
from tests.unit.test_moe import tiny_glm

CPU = torch.device("cpu")
VOCAB = 256
ARCHS = [
    tiny_llama(),
    tiny_qwen3(),
    tiny_llama(tie_word_embeddings=True, head_dim=32),
    tiny_glm(attn_output_gate="headwise", xsa=True, null_experts=2),
    tiny_glm(moe_latent_size=16, expert_glu="situ_glu", router_bias_on_logits=True),
]
ARCH_IDS = ["llama", "qwen3", "tied", "glm-research-options", "glm-latent-situ"]


def _model(arch: object, std: float = 0.05, seed: int = 3) -> CausalLM:
    model = build_model(arch, VOCAB, "sdpa", CPU)  # type: ignore[arg-type]
    init_weights(model, std, seed=seed)
    return model.eval()


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_prefill_then_decode_matches_training_forward(arch: object, one_thread: object) -> None:
    model = _model(arch)
    ids = _ids(24)
    with torch.no_grad():
        full = model(ids[None], torch.arange(24)[None], torch.tensor([24], dtype=torch.int32))[0]
    cache = KVCache(model, 24)
    steps = [forward_with_cache(model, ids[:10], cache)]
    steps += [forward_with_cache(model, ids[i : i + 1], cache) for i in range(10, 24)]
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)


def test_cache_overflow_is_a_clear_error() -> None:
    model = _model(tiny_llama())
    cache = KVCache(model, 8)
    forward_with_cache(model, _ids(6), cache)
    with pytest.raises(ValueError, match="max_len 8"):
        forward_with_cache(model, _ids(3), cache)
    assert cache.length == 6


def _hf_greedy(model: CausalLM, prompt: torch.Tensor, n: int) -> list[int]:
    transformers = require("transformers")
    from tests.unit.test_model import _hf

    hf = _hf(model)
    out = hf.generate(
        input_ids=prompt[None],
        attention_mask=torch.ones_like(prompt)[None],
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
        generation_config=transformers.GenerationConfig(),
    )
    return out[0, prompt.numel() :].tolist()


@pytest.mark.parametrize("arch", ARCHS[:2], ids=ARCH_IDS[:2])
def test_greedy_matches_transformers(arch: object, one_thread: object) -> None:
    model = _model(arch, std=0.2, seed=7)
    prompt = _ids(8, seed=1)
    ours = list(generate(model, prompt.tolist(), 20, temperature=0.0, eos_id=None))
    theirs = _hf_greedy(model, prompt, 20)
    assert len(ours) == 20
    assert len(set(ours)) > 1, "degenerate continuation: the comparison would prove little"
    assert ours == theirs


def test_sampling_is_seeded_and_top_p_tiny_is_greedy() -> None:
    model = _model(tiny_qwen3(), std=0.2, seed=7)
    prompt = _ids(5, seed=2).tolist()
    a = list(generate(model, prompt, 30, temperature=1.0, seed=11))
    b = list(generate(model, prompt, 30, temperature=1.0, seed=11))
    c = list(generate(model, prompt, 30, temperature=1.0, seed=12))
    assert a == b and len(a) == 30
    assert a != c
    greedy = list(generate(model, prompt, 30, temperature=0.0))
    assert list(generate(model, prompt, 30, temperature=1.0, top_p=1e-6, seed=5)) == greedy


def test_stops_at_eos_and_yields_it() -> None:
    model = _model(tiny_llama(), std=0.2, seed=7)
    prompt = _ids(5, seed=3).tolist()
    free = list(generate(model, prompt, 30, seed=4))
    eos = free[6]
    first = free.index(eos)
    assert list(generate(model, prompt, 30, seed=4, eos_id=eos)) == free[: first + 1]


def test_stops_at_max_position_embeddings() -> None:
    model = _model(tiny_llama(max_position_embeddings=16))
    assert len(list(generate(model, _ids(10).tolist(), 100))) == 6
    assert list(generate(model, _ids(16).tolist(), 5)) == []
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, _ids(17).tolist(), 5)


def test_bad_arguments_raise_before_generating() -> None:
    model = _model(tiny_llama())
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 5)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, [VOCAB], 5)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [1], 5, top_p=0.0)


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.45, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_exactly_the_nucleus(top_p: float, allowed: set[int]) -> None:
    by_rank = [0.5, 0.3, 0.15, 0.05]
    # Token ids in scrambled order, so the test also checks that the nucleus maps back to the original ids.
    id_of_rank = [2, 0, 3, 1]
    logits = torch.empty(4)
    logits[id_of_rank] = torch.log(torch.tensor(by_rank))
    rank_of_id = {token: r for r, token in enumerate(id_of_rank)}
    gen = torch.Generator().manual_seed(0)
    draws = 3000
    counts = Counter(rank_of_id[sample_next(logits, 1.0, top_p, gen)] for _ in range(draws))
    assert set(counts) == allowed
    # Within the nucleus the draws follow the renormalized probabilities.
    mass = sum(by_rank[r] for r in allowed)
    for r in allowed:
        assert abs(counts[r] / draws - by_rank[r] / mass) < 0.04


def test_greedy_and_temperature() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9], dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0.0, 0.5, gen) == 1
    # A very low temperature concentrates all mass on the argmax.
    assert {sample_next(logits, 1e-3, 1.0, gen) for _ in range(50)} == {1}


def test_text_stream_holds_back_incomplete_characters() -> None:
    tok = train_bpe(["hello world, a naive cafe", "plain ascii text only"] * 5, vocab_size=300, min_frequency=1)
    text = "naïve café — 東京 🚀!"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    # The text must really split characters across tokens for the hold-back to be exercised.
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]


def test_text_stream_flush_returns_a_dangling_byte() -> None:
    tok = train_bpe(["abc"] * 3, vocab_size=300, min_frequency=1)
    ids = tok.encode("é").ids
    stream = TextStream(tok)
    assert stream.push(ids[0]) == ""
    assert stream.flush() == "\ufffd"
