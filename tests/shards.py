"""Test helpers: a word-level tokenizer folder and token shards written in datatrove's layout."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

EOS = "<|endoftext|>"


def word_tokenizer(folder: Path, size: int = 300) -> Path:
    """A tokenizer folder with ids 0..size-1: EOS at 0, then the words w1, w2, ..."""
    vocab = {EOS: 0, **{f"w{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def write_shard(
    folder: Path, name: str, docs: Sequence[Sequence[int]], token_size: int = 2, loss: Sequence[int] | None = None
) -> Path:
    """Write documents (token id lists, EOS included by the caller) as NAME.ds + .index + .metadata (+ .loss)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([np.asarray(d) for d in docs]).astype("<u2" if token_size == 2 else "<u4")
    ends = np.cumsum([len(d) for d in docs]).astype(np.uint64)
    path = folder / f"{name}.ds"
    tokens.tofile(path)
    ends.tofile(folder / f"{name}.ds.index")
    (folder / f"{name}.ds.metadata").write_text(f"test-tokenizer|{token_size}\n{len(tokens)}\n")
    if loss is not None:
        np.asarray(loss, dtype=np.uint8).tofile(folder / f"{name}.ds.loss")
    return path


def random_docs(n: int, seed: int, eos: int = 0, vocab: int = 300, mean_len: int = 20) -> list[list[int]]:
    """n documents of random word ids (1..vocab-1), each ending with EOS."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 2 * mean_len, size=n)
    return [[*rng.integers(1, vocab, size=int(k - 1)).tolist(), eos] for k in lengths]
