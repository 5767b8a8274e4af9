"""Test helpers for SFT: a small byte-level BPE tokenizer with a ChatML template, and chat data files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

WORDS = "the king speaks and the queen answers why do you ask what is the weather today tool result ok".split()  # noqa: SIM905


def chat_tokenizer(folder: Path) -> Path:
    """A ChatML tokenizer folder (byte-level BPE, 400 ids) trained on a few made-up sentences."""
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(200)]
    save_tokenizer_folder(train_bpe(texts, vocab_size=400, min_frequency=1), folder)
    return folder


def conversation(i: int, turns: int = 2, system: bool = False, tool: bool = False) -> list[dict[str, Any]]:
    """A made-up conversation: optional system prompt, user/assistant pairs, optional tool call and result."""
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": "you answer the king"})
    for t in range(turns):
        messages.append({"role": "user", "content": f"why do you ask {WORDS[(i + t) % len(WORDS)]}"})
        if tool and t == 0:
            messages.append({"role": "assistant", "content": "tool weather today"})
            messages.append({"role": "tool", "content": f"result ok {i}"})
        answer = " ".join(WORDS[(i * 3 + t + k) % len(WORDS)] for k in range(1 + (i + t) % 9))
        messages.append({"role": "assistant", "content": answer})
    return messages


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Rows as a JSON-lines file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
