"""lm-evaluation-harness's conventions for eval set files (`val.convention = "lmeval"`), so that in-loop numbers
equal what the harness (0.4.x, `--model hf`) reports for the exported model at `max_length` L.

Where they differ from lmforge's own rules (`lmforge.eval.sets`):

- **Tokenization.** A text is encoded as the harness's HF model does by default: with the tokenizer's special
  tokens (its post-processor, e.g. a BOS that a Llama 3 tokenizer adds; lmforge's own tokenizers add none), unless
  the text already starts with the prefix token's text. No EOS is put in front.
- **Context and continuation** (`ctxcont`, `pairs`). Whitespace at the end of the context moves to the start of the
  continuation; the continuation's tokens are those of context + continuation after the context's own tokens, even
  when a token merges across the boundary (lmforge then encodes the continuation alone).
- **Empty context** (every `pairs` item). The continuation is encoded without special tokens and conditioned on the
  prefix token: the tokenizer's BOS, else its EOS. When the continuation itself starts with that token, its first
  token is the context instead and is not scored.
- **Length.** At context length L a request keeps its last L + 1 tokens (L scored positions, the harness's
  `max_length`), where lmforge keeps L tokens.
- **Perplexity sets** (`ppl`). Each text is scored in rolling windows of L positions: the first window is the prefix
  token then the text's first L tokens, every later one scores the next (at most L) tokens given the L + 1 - n
  tokens before them, so every token of the text is scored exactly once and no EOS is appended. The figures are the
  harness's: `word_perplexity` (per whitespace-separated word), `byte_perplexity` and `bpb` (per UTF-8 byte of the
  text), besides `loss` and `ppl` per scored token.
- **Choice metrics.** `acc_norm` divides each log-likelihood by the continuation's characters, `acc_bytes` by its
  UTF-8 bytes (the target delimiter not counted), and a pair counts as right when the good text is at least as
  likely as the bad one (`set_metrics`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from lmforge.data.tokenizer import TokenizerInfo
from lmforge.eval.sets import EvalSetError, Item, Request, choice_request, move_trailing_space


def prefix_id(tokenizer: TokenizerInfo) -> int:
    """The token that conditions an empty context and a text's first rolling window: BOS, else EOS."""
    return tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id


def encode(tokenizer: TokenizerInfo, text: str, special: bool = True) -> list[int]:
    """The harness's ids of `text`: with the tokenizer's special tokens when `special`, except for a text that
    already starts with the prefix token's text."""
    tok = tokenizer.tokenizer
    prefix_text = tok.decode([prefix_id(tokenizer)], skip_special_tokens=False)
    add = special and not text.startswith(prefix_text)
    return list(tok.encode(text, add_special_tokens=add).ids)


def harness_requests(items: Sequence[Item], tokenizer: TokenizerInfo) -> list[Request]:
    """One request per continuation of every item, in (item, choice) order, tokenized as the harness does (see the
    module docstring)."""
    prefix = prefix_id(tokenizer)
    requests: list[Request] = []
    for i, item in enumerate(items):
        for j, choice in enumerate(item.continuations):
            continuation = item.target_delimiter + choice
            if item.context == "":
                ids = encode(tokenizer, continuation, special=False)
                if not ids:
                    raise EvalSetError(f"{item.where}: continuation {j} gives no tokens")
                ctx, ids = ([prefix], ids) if ids[0] != prefix else (ids[:1], ids[1:])
            else:
                context, continuation = move_trailing_space(item.context, continuation)
                ctx = encode(tokenizer, context)
                if not ctx:
                    raise EvalSetError(
                        f"{item.where}: the context is only whitespace, which the harness scores without any "
                        "conditioning token; make it empty or give it text"
                    )
                ids = encode(tokenizer, context + continuation)[len(ctx) :]
            requests.append(choice_request(item, i, j, ctx, ids))
    return requests


def rolling_requests(texts: Sequence[str], tokenizer: TokenizerInfo, max_length: int) -> list[Request]:
    """The rolling windows of every text at `max_length` L, in text order, as requests whose `item` is the text's
    index and `choice` the window's (see the module docstring)."""
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    prefix = prefix_id(tokenizer)
    requests: list[Request] = []
    for d, text in enumerate(texts):
        tokens = encode(tokenizer, text)
        first = min(max_length, len(tokens))
        windows = [([prefix], tokens[:first])] if tokens else []
        done = first
        while done < len(tokens):
            end = done + min(len(tokens) - done, max_length)
            windows.append((tokens[end - max_length - 1 : done], tokens[done:end]))
            done = end
        for k, (context, scored) in enumerate(windows):
            requests.append(Request(d, k, np.asarray(context, np.int64), np.asarray(scored, np.int64), 0, 0))
    return requests


def count_words(text: str) -> int:
    """Words of a text as the harness counts them for `word_perplexity`: the pieces between whitespace runs."""
    return len(re.split(r"\s+", text))


def text_logliks(requests: Sequence[Request], loglik: np.ndarray, n_texts: int) -> np.ndarray:
    """float64 [n_texts]: each text's log-likelihood, the sum over its rolling windows."""
    totals = np.zeros(n_texts, dtype=np.float64)
    np.add.at(totals, np.asarray([r.item for r in requests], dtype=np.int64), np.asarray(loglik, np.float64))
    return totals


def rolling_metrics(texts: Sequence[str], requests: Sequence[Request], loglik: np.ndarray) -> dict[str, float]:
    """`loss`, `ppl`, `bpb`, `word_perplexity` and `byte_perplexity` of a `ppl` set scored in rolling windows."""
    total = float(text_logliks(requests, loglik, len(texts)).sum())
    tokens = sum(len(r.continuation) for r in requests)
    words = sum(count_words(t) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    loss = -total / max(tokens, 1)
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 80.0)),
        "bpb": -total / (math.log(2) * nbytes) if nbytes else math.nan,
        "word_perplexity": _exp(-total / words),
        "byte_perplexity": _exp(-total / nbytes) if nbytes else math.nan,
    }


def _exp(x: float) -> float:
    # The harness reports these unclamped; only a float overflow becomes inf.
    return math.exp(x) if x < 709.0 else math.inf
