"""The lmeval convention: tokenization equal to lm-evaluation-harness's own code for several kinds of tokenizer,
rolling windows that score every token once, and the harness's metrics."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.eval.harness import (
    count_words,
    encode,
    harness_requests,
    prefix_id,
    rolling_metrics,
    rolling_requests,
    text_logliks,
)
from lmforge.eval.sets import EvalSetError, Item, fit_requests, set_metrics
from lmforge.prep.tokenizer_train import BOS_TOKEN
from tests.chat import chat_tokenizer
from tests.conftest import require
from tests.shards import word_tokenizer

PAIRS = [
    ("the king", " said"),
    ("the king ", "said"),  # trailing whitespace moves to the continuation
    ("the ki", "ng said"),  # cut mid-word: a token may merge across the boundary
    ("Question: wörd?\n", "Answer: ånswer ✓"),  # non-ASCII, a newline at the end
    ("", " héllo the king"),  # empty context: conditioned on the prefix token
    ("", BOS_TOKEN + "the king"),  # a continuation that starts with the prefix token
]
TEXTS = ["", "king", "the king said yes and more words here to roll over several windows", "héllo wörld ✓ " * 4]


def _bos_adding(folder: Path, base: Path) -> Path:
    """`base` with a post-processor that puts BOS in front of every text, as Llama 3's tokenizer does."""
    shutil.copytree(base, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos)]
    )
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module", params=["lmforge-bpe", "bos-adding", "no-bos"])
def tok_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("tok")
    if request.param == "no-bos":
        return word_tokenizer(base / "words")
    chat = chat_tokenizer(base / "bpe")
    return chat if request.param == "lmforge-bpe" else _bos_adding(base / "bos", chat)


def _harness_lm(folder: Path, max_length: int) -> Any:
    """lm-evaluation-harness's HF model class without a model: its tokenization runs as it is, and the token
    requests it would score are recorded instead."""
    transformers = require("transformers")
    huggingface = require("lm_eval.models.huggingface")
    from lm_eval.api.model import CacheHook

    lm = huggingface.HFLM.__new__(huggingface.HFLM)
    lm.tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    lm.add_bos_token, lm.custom_prefix_token_id, lm.backend, lm.enable_thinking = None, None, "causal", False
    lm._max_length, lm.batch_size_per_gpu, lm._rank, lm._world_size = max_length, 1, 0, 1
    lm.cache_hook = CacheHook(None)
    lm.seen = []
    lm._loglikelihood_tokens = lambda requests, **_: (lm.seen.extend(requests), [(0.0, False)] * len(requests))[1]
    return lm


def test_choice_tokens_equal_the_harness(tok_folder: Path) -> None:
    from lm_eval.api.instance import Instance

    tok = load_tokenizer(tok_folder)
    lm = _harness_lm(tok_folder, 64)
    pairs = [(c, x) for c, x in PAIRS if not (tok.bos_id is None and BOS_TOKEN in x)]
    lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    items = [Item(c, (x,), 0, f"item {i}") for i, (c, x) in enumerate(pairs)]
    ours = [(r.context.tolist(), r.continuation.tolist()) for r in harness_requests(items, tok)]
    assert ours == [(list(ctx), list(cont)) for _, ctx, cont in lm.seen]


def test_rolling_windows_equal_the_harness_and_score_every_token_once(tok_folder: Path) -> None:
    from lm_eval.api.instance import Instance

    tok = load_tokenizer(tok_folder)
    for max_length in (1, 3, 8):
        lm = _harness_lm(tok_folder, max_length)
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(TEXTS)],
                                 disable_tqdm=True)  # fmt: skip
        requests = rolling_requests(TEXTS, tok, max_length)
        assert [(r.context.tolist(), r.continuation.tolist()) for r in requests] == [
            (list(ctx), list(cont)) for _, ctx, cont in lm.seen
        ]
        for d, text in enumerate(TEXTS):
            mine = [r for r in requests if r.item == d]
            assert [x for r in mine for x in r.continuation.tolist()] == encode(tok, text)
            assert all(len(r.context) + len(r.continuation) <= max_length + 1 for r in mine)
            assert all(len(r.context) >= 1 for r in mine)


def test_the_prefix_is_bos_else_eos(tmp_path: Path) -> None:
    bpe = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    words = load_tokenizer(word_tokenizer(tmp_path / "words"))
    assert prefix_id(bpe) == bpe.bos_id != bpe.eos_id
    assert words.bos_id is None and prefix_id(words) == words.eos_id
    # an empty context is conditioned on BOS, not on lmforge's EOS
    (request,) = harness_requests([Item("", (" the king",), 0, "x")], bpe)
    assert request.context.tolist() == [bpe.bos_id]


def test_unscorable_items_name_the_item(tmp_path: Path) -> None:
    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    with pytest.raises(EvalSetError, match=r"sets/q\.jsonl line 3: continuation 1 gives no tokens"):
        harness_requests([Item("the kin", (" said", "g"), 0, "sets/q.jsonl line 3")], tok)  # "king" merges
    with pytest.raises(EvalSetError, match=r"line 4: the context is only whitespace"):
        harness_requests([Item("  ", ("the", "king"), 0, "line 4")], tok)


def test_harness_requests_keep_max_length_plus_one_tokens(tmp_path: Path) -> None:
    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    items = [Item("the king said yes and more words", (" here",), 0, "x")]
    (whole,) = harness_requests(items, tok)
    (fitted,) = fit_requests([whole], 4, items)
    assert fitted.tokens.tolist() == whole.tokens.tolist()[-5:]


def _request_set(tok: TokenizerInfo, choices: tuple[str, ...], delimiter: str = " ") -> list[Any]:
    return harness_requests([Item("q", choices, 0, "x", delimiter)], tok)


def test_acc_norm_counts_characters_and_acc_bytes_counts_bytes(tmp_path: Path) -> None:
    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    # "ééé" is 3 characters and 6 bytes, "abcd" 4 of each; the delimiter counts in neither
    items = [Item("q", ("ééé", "abcd"), 0, "x", " ")]
    requests = harness_requests(items, tok)
    assert [(r.nchars, r.nbytes) for r in requests] == [(3, 6), (4, 4)]
    assert requests[0].continuation.tolist() == encode(tok, "q ééé")[len(encode(tok, "q")) :]
    loglik = np.array([-3.3, -4.0])  # per character: -1.1 vs -1.0 -> choice 1; per byte: -0.55 vs -1.0 -> choice 0
    assert set_metrics("ctxcont", items, requests, loglik, "lmeval") == {"acc": 1.0, "acc_norm": 0.0, "acc_bytes": 1.0}
    assert set_metrics("ctxcont", items, requests, loglik, "lmforge") == {"acc": 1.0, "acc_norm": 1.0}


def test_a_tied_pair_counts_as_right_only_under_lmeval(tmp_path: Path) -> None:
    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    items = [Item("", ("a b", "b a"), 0, "x"), Item("", ("c d", "d c"), 0, "y")]
    requests = harness_requests(items, tok)
    loglik = np.array([-2.0, -2.0, -3.0, -1.0])
    assert set_metrics("pairs", items, requests, loglik, "lmeval") == {"acc": 0.5}
    assert set_metrics("pairs", items, requests, loglik, "lmforge") == {"acc": 0.0}
    with pytest.raises(ValueError, match="unknown convention 'harness'"):
        set_metrics("pairs", items, requests, loglik, "harness")


def test_rolling_metrics_are_the_harness_aggregates(tmp_path: Path) -> None:
    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    texts = ["the king  said", "héllo\nwörld"]
    requests = rolling_requests(texts, tok, 3)
    loglik = -np.linspace(0.5, 2.0, len(requests))
    per_text = text_logliks(requests, loglik, len(texts))
    assert per_text.sum() == pytest.approx(loglik.sum())
    assert [count_words(t) for t in texts] == [3, 2]
    nbytes = sum(len(t.encode()) for t in texts)
    metrics = rolling_metrics(texts, requests, loglik)
    assert metrics["word_perplexity"] == pytest.approx(math.exp(-per_text.sum() / 5))
    assert metrics["byte_perplexity"] == pytest.approx(math.exp(-per_text.sum() / nbytes))
    assert metrics["bpb"] == pytest.approx(-per_text.sum() / nbytes / math.log(2))
    tokens = sum(len(encode(tok, t)) for t in texts)
    assert metrics["loss"] == pytest.approx(-loglik.sum() / tokens)
    assert metrics["ppl"] == pytest.approx(math.exp(metrics["loss"]))


def test_harness_aggregates_match_lm_eval_formulas(tmp_path: Path) -> None:
    metrics_mod = require("lm_eval.api.metrics")
    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    texts = ["a b c", "d e", "fgh ij k"]
    requests = rolling_requests(texts, tok, 2)
    loglik = -np.linspace(1.0, 3.0, len(requests))
    per_text = text_logliks(requests, loglik, len(texts))
    ours = rolling_metrics(texts, requests, loglik)
    words = [(float(ll), len(t.split())) for ll, t in zip(per_text, texts, strict=True)]
    nbytes = [(float(ll), len(t.encode())) for ll, t in zip(per_text, texts, strict=True)]
    assert ours["word_perplexity"] == pytest.approx(metrics_mod.weighted_perplexity(words))
    assert ours["byte_perplexity"] == pytest.approx(metrics_mod.weighted_perplexity(nbytes))
    assert ours["bpb"] == pytest.approx(metrics_mod.bits_per_byte(nbytes))


def test_target_delimiter_rows_are_read_and_scored_between_context_and_choice(tmp_path: Path) -> None:
    from lmforge.eval.sets import build_requests, read_eval_set

    tok = load_tokenizer(chat_tokenizer(tmp_path / "bpe"))
    row = {"context": "the king", "continuations": ["said", "yes"], "label": 1, "target_delimiter": " "}
    path = tmp_path / "mc.ctxcont.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (item,) = read_eval_set(path).items
    assert item.target_delimiter == " " and item.continuations == ("said", "yes")
    spaced = Item("the king", (" said", " yes"), 1, "x")
    for build in (build_requests, harness_requests):
        got, want = build([item], tok), build([spaced], tok)
        assert [r.tokens.tolist() for r in got] == [r.tokens.tolist() for r in want]
        assert [r.nbytes for r in got] == [4, 3]  # without the delimiter
