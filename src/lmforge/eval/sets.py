"""Eval set files, the log-likelihood requests they make, and the metrics computed from the scores.

A set is one JSON-lines or Parquet file. Its kind comes from the file name `NAME.KIND.jsonl` (or `.parquet`, KIND
one of `ppl`, `ctxcont`, `pairs`), or else from a `kind` field that every row has with the same value. NAME (the
whole stem when the name gives no kind) names the set in the metric keys `val/<NAME>/<metric>@<length>`.

- `ppl` rows `{"text": str}`: documents scored like a held-out token folder (loss, perplexity, bits per byte).
- `ctxcont` rows `{"context": str, "continuations": [str, ...], "label": int}`: multiple choice; `acc` is the share
  of items whose most likely continuation is the labelled one, `acc_norm` the same with each log-likelihood divided
  by the continuation's UTF-8 bytes (as stored, before the delimiter and the whitespace rule below).
- `pairs` rows `{"good": str, "bad": str}`: minimal pairs (BLiMP-style); `acc` is the share of items where the
  good text is the more likely one. It is scored as a `ctxcont` item with an empty context, continuations
  [good, bad] and label 0.

In `ctxcont`, ties go to the first choice (numpy's argmax), as in lm-evaluation-harness. A pair counts as right
only when the good text is strictly more likely than the bad one.

These are lmforge's own conventions; `lmforge.eval.harness` has lm-evaluation-harness's (`val.convention`).
Tokenization matches the token shards `lmforge tokenize` writes (datatrove replaces the tokenizer's post-processor,
so no BOS; every document ends with EOS): a text is encoded without special tokens, and every scored text comes
after one EOS, since in the shards a document starts right after the previous one's EOS. A `ppl` document is
[EOS] + ids(text) + [EOS]. A choice is [EOS] + ids(context) followed by the continuation's ids, and only the
continuation's tokens are scored.

The continuation is appended to the context exactly as stored, after the row's optional `target_delimiter` (default
none), so a set whose answers follow a space stores that space (`" Paris"`) or sets `target_delimiter = " "`.
Whitespace at the end of a context moves to the start of each continuation before tokenizing (`"Q: A:" + " " + "x"`
rather than `"Q: A: "` + `"x"`), as lm-evaluation-harness does, because BPE tokenizers attach a space to the word
after it. The continuation's ids are those of context + continuation after the context's own ids when the context's
ids are a prefix of them (a merge across the boundary would break this), else the continuation encoded alone.

A request longer than the context length L (L + 1 tokens are L scored positions, like a training window) loses
tokens from the left, the EOS first, so the continuation stays whole; a continuation longer than L is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lmforge.data.records import Record, RecordError, read_records
from lmforge.data.tokenizer import TokenizerInfo

KINDS = ("ppl", "ctxcont", "pairs")
"""The kinds of eval set."""
SUFFIXES = (".jsonl", ".parquet")
"""File types an eval set may have."""


class EvalSetError(ValueError):
    """An eval set file or row that cannot be used; the message names the file (and row)."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice question (`ctxcont`) or minimal pair (`pairs`: context "", choices [good, bad])."""

    context: str
    """Text before every continuation, as stored."""
    continuations: tuple[str, ...]
    """The choices, at least two, as stored."""
    label: int
    """Index of the right continuation."""
    where: str
    """File and line (or row) of the item, for messages."""
    target_delimiter: str = ""
    """Text put between the context and every continuation when scoring (the harness's `target_delimiter`); the
    normalizing lengths of `acc_norm` count the continuation without it."""


@dataclass(frozen=True)
class EvalSet:
    """One eval set file, read and checked."""

    name: str
    """The set's name in metric keys."""
    kind: str
    """One of `KINDS`."""
    path: Path
    """The file."""
    texts: tuple[str, ...] = ()
    """The documents of a `ppl` set."""
    items: tuple[Item, ...] = ()
    """The items of a `ctxcont` or `pairs` set."""


def name_and_kind(path: Path) -> tuple[str, str | None]:
    """The set name and kind a file name gives (`NAME.KIND.jsonl`); kind None when the name has none."""
    stem = path.name.removesuffix(path.suffix)
    base, dot, kind = stem.rpartition(".")
    return (base, kind) if dot and base and kind in KINDS else (stem, None)


def read_eval_set(path: str | Path) -> EvalSet:
    """Read and check one set file (see the module docstring for the formats)."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise EvalSetError(f"{path}: an eval set is a {' or '.join(SUFFIXES)} file")
    name, kind = name_and_kind(path)
    try:
        records = list(read_records([path]))
    except RecordError as e:
        raise EvalSetError(str(e)) from None
    if not records:
        raise EvalSetError(f"{path}: the set is empty")
    kind = _kind(path, records, kind)
    if kind == "ppl":
        return EvalSet(name, kind, path, texts=tuple(_string(r, "text") for r in records))
    parse = _ctxcont_item if kind == "ctxcont" else _pair_item
    return EvalSet(name, kind, path, items=tuple(parse(r) for r in records))


def read_eval_dir(folder: str | Path) -> list[EvalSet]:
    """Every set file of a folder, in file-name order; two files may not give the same set name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EvalSetError(f"{folder}: not a folder")
    sets = [read_eval_set(p) for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in SUFFIXES]
    if not sets:
        raise EvalSetError(f"{folder}: no {' or '.join('*' + s for s in SUFFIXES)} eval set files")
    seen: dict[str, Path] = {}
    for s in sets:
        if s.name in seen:
            raise EvalSetError(f"{s.path} and {seen[s.name]} both give the set name {s.name!r}")
        seen[s.name] = s.path
    return sets


def _kind(path: Path, records: list[Record], from_name: str | None) -> str:
    if from_name is not None:
        for r in records:
            if r.data.get("kind", from_name) != from_name:
                raise EvalSetError(f"{r.where()}: kind {r.data['kind']!r} contradicts the file name's {from_name!r}")
        return from_name
    kind = records[0].data.get("kind")
    if kind not in KINDS:
        raise EvalSetError(
            f"{records[0].where()}: unknown set kind {kind!r}; name the file NAME.KIND{path.suffix} or give every "
            f"row a 'kind' field, KIND one of {', '.join(KINDS)}"
        )
    for r in records:
        if r.data.get("kind") != kind:
            raise EvalSetError(f"{r.where()}: kind {r.data.get('kind')!r} differs from the first row's {kind!r}")
    return str(kind)


def _field(record: Record, field: str) -> Any:
    if field not in record.data or record.data[field] is None:
        raise EvalSetError(f"{record.where()}: missing field {field!r}")
    return record.data[field]


def _string(record: Record, field: str) -> str:
    value = _field(record, field)
    if not isinstance(value, str):
        raise EvalSetError(f"{record.where()}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _ctxcont_item(record: Record) -> Item:
    context = _string(record, "context")
    choices, label = _field(record, "continuations"), _field(record, "label")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise EvalSetError(f"{record.where()}: 'continuations' must be a list of strings")
    if len(choices) < 2:
        raise EvalSetError(f"{record.where()}: 'continuations' needs at least 2 choices, got {len(choices)}")
    if not all(choices):
        raise EvalSetError(f"{record.where()}: continuation {choices.index('')} is empty")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise EvalSetError(f"{record.where()}: 'label' {label!r} is not a choice index in [0, {len(choices)})")
    return Item(context, tuple(choices), label, record.where(), _delimiter(record))


def _pair_item(record: Record) -> Item:
    good, bad = _string(record, "good"), _string(record, "bad")
    if not good or not bad:
        raise EvalSetError(f"{record.where()}: 'good' and 'bad' must not be empty")
    return Item("", (good, bad), 0, record.where(), _delimiter(record))


def _delimiter(record: Record) -> str:
    return _string(record, "target_delimiter") if record.data.get("target_delimiter") is not None else ""


def _encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def ppl_tokens(texts: Sequence[str], tokenizer: TokenizerInfo) -> tuple[np.ndarray, np.ndarray]:
    """A `ppl` set as one int64 token array of [EOS] + ids(text) + [EOS] documents, and the offsets where the
    documents after the first start (as `ShardPool.read` gives them to `validation.chunk_rows`)."""
    eos = tokenizer.eos_id
    docs = [np.asarray([eos, *ids, eos], dtype=np.int64) for ids in _encode(tokenizer.tokenizer, list(texts))]
    return np.concatenate(docs), np.cumsum([len(d) for d in docs])[:-1].astype(np.int64)


def move_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    """The whitespace rule: whitespace at the end of the context moves to the start of the continuation."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


@dataclass(frozen=True)
class Request:
    """One continuation to score: sum of log p(continuation token | everything before it)."""

    item: int
    """Index of the item in its set."""
    choice: int
    """Index of the continuation in the item."""
    context: np.ndarray
    """int64 ids the continuation is conditioned on: the EOS, then the context's (left-truncated by
    `fit_requests`, which may drop the EOS too)."""
    continuation: np.ndarray
    """int64 ids of the continuation: the scored tokens."""
    nbytes: int
    """UTF-8 bytes of the continuation as stored, without the target delimiter (the divisor of lmforge's
    `acc_norm` and of `acc_bytes`)."""
    nchars: int
    """Characters of the continuation as stored, without the target delimiter (the divisor of the harness's
    `acc_norm`)."""

    @property
    def tokens(self) -> np.ndarray:
        """Context then continuation ids: the segment that scores this request."""
        return np.concatenate([self.context, self.continuation])


def build_requests(items: Sequence[Item], tokenizer: TokenizerInfo) -> list[Request]:
    """One request per continuation of every item, in (item, choice) order (tokenized as the module says)."""
    tok, eos = tokenizer.tokenizer, tokenizer.eos_id
    requests: list[Request] = []
    for i, item in enumerate(items):
        pairs = [move_trailing_space(item.context, item.target_delimiter + c) for c in item.continuations]
        context = pairs[0][0]
        ctx_ids, *wholes = _encode(tok, [context, *(context + c for _, c in pairs)])
        for j, (whole, (_, cont)) in enumerate(zip(wholes, pairs, strict=True)):
            ids = whole[len(ctx_ids) :] if whole[: len(ctx_ids)] == ctx_ids else _encode(tok, [cont])[0]
            requests.append(choice_request(item, i, j, [eos, *ctx_ids], ids))
    return requests


def choice_request(item: Item, index: int, choice: int, context: Sequence[int], continuation: Sequence[int]) -> Request:
    """The request of continuation `choice` of `item` (number `index` in its set), tokenized as given."""
    if not continuation:
        raise EvalSetError(f"{item.where}: continuation {choice} gives no tokens")
    text = item.continuations[choice]
    return Request(index, choice, np.asarray(context, dtype=np.int64), np.asarray(continuation, dtype=np.int64),
                   len(text.encode("utf-8")), len(text))  # fmt: skip


def fit_requests(requests: Sequence[Request], seq_len: int, items: Sequence[Item]) -> list[Request]:
    """The requests at context length `seq_len`: each keeps at most its last `seq_len + 1` tokens, dropped from the
    left of its context; a continuation of more than `seq_len` tokens is an error naming its item."""
    fitted: list[Request] = []
    for r in requests:
        extra = len(r.context) + len(r.continuation) - (seq_len + 1)
        if extra > 0 and len(r.continuation) > seq_len:
            raise EvalSetError(
                f"{items[r.item].where}: continuation {r.choice} has {len(r.continuation)} tokens, more than the "
                f"context length {seq_len}"
            )
        fitted.append(replace(r, context=r.context[extra:]) if extra > 0 else r)
    return fitted


CONVENTIONS = ("lmforge", "lmeval")
"""How sets are tokenized and scored: lmforge's own rules (this module) or lm-evaluation-harness's
(`lmforge.eval.harness`)."""


def set_metrics(kind: str, items: Sequence[Item], requests: Sequence[Request], loglik: np.ndarray,
                convention: str = "lmforge") -> dict[str, float]:  # fmt: skip
    """The choice metrics of a `ctxcont` or `pairs` set from the per-request log-likelihood sums `loglik` (aligned
    with `requests`).

    lmforge: `acc` and `acc_norm` (log-likelihood per UTF-8 byte) for ctxcont; for pairs, `acc` counts a pair
    only when the good text is strictly more likely. lmeval (the harness's): `acc`, `acc_norm` (log-likelihood per
    character) and `acc_bytes` (per UTF-8 byte) for ctxcont; pairs are multiple choice with the good text first,
    so a tie counts as right. Ties among choices go to the lower index (numpy's argmax) in both."""
    if kind not in ("ctxcont", "pairs"):
        raise ValueError(f"set kind {kind!r} has no choice metrics")
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; one of {', '.join(CONVENTIONS)}")
    scores = [np.full(len(item.continuations), -np.inf) for item in items]
    per_byte = [np.full(len(item.continuations), -np.inf) for item in items]
    per_char = [np.full(len(item.continuations), -np.inf) for item in items]
    for r, ll in zip(requests, np.asarray(loglik, dtype=np.float64), strict=True):
        scores[r.item][r.choice] = ll
        per_byte[r.item][r.choice] = ll / r.nbytes
        per_char[r.item][r.choice] = ll / r.nchars
    labels = np.asarray([item.label for item in items])

    def accuracy(values: list[np.ndarray]) -> float:
        return float(np.mean(np.asarray([np.argmax(v) for v in values]) == labels))

    if kind == "pairs":
        if convention == "lmeval":
            return {"acc": accuracy(scores)}
        return {"acc": float(np.mean([s[0] > s[1] for s in scores]))}
    if convention == "lmeval":
        return {"acc": accuracy(scores), "acc_norm": accuracy(per_char), "acc_bytes": accuracy(per_byte)}
    return {"acc": accuracy(scores), "acc_norm": accuracy(per_byte)}
