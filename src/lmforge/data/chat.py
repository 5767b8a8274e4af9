"""Conversations as tokens with a loss mask per role, from the tokenizer's own chat template.

A conversation is rendered once with the tokenizer's Jinja chat template (sandboxed, with the globals that
Hugging Face templates use). Turn i spans the text from where the render of the first i messages ends to where
the render of the first i+1 messages ends, so the template must render every prefix of a conversation as a prefix
of the whole; one that does not (it rewrites earlier turns once later ones exist) is refused with the turn named.
An assistant turn's loss part starts after the generation prompt (the render of the turns before it with
`add_generation_prompt`), which the model is given at inference time; the other roles' turns count whole.

A token counts toward the loss when its first character lies in the loss part of a turn whose role is selected.
Everything here is plain Python and numpy: it runs in the data worker thread, where torch ops must not run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmforge.data.tokenizer import TokenizerInfo

ROLES = ("system", "user", "assistant", "tool")
"""The roles `data.loss_mask` can select."""


class ChatError(ValueError):
    """A conversation or chat template that cannot be turned into tokens; the message says which and why."""


@dataclass(frozen=True)
class Span:
    """The characters of one turn in the rendered conversation."""

    role: str
    """The turn's role."""
    start: int
    """First character of the turn."""
    loss_start: int
    """First character that can count toward the loss (after an assistant turn's generation prompt)."""
    end: int
    """One past the turn's last character."""


@dataclass(frozen=True)
class Tokens:
    """One sample: token ids and which of them are loss targets."""

    ids: np.ndarray
    """int32 token ids."""
    loss: np.ndarray
    """bool per token: the token is a target that counts (a token is predicted from the ones before it)."""


class _GenerationTag(Extension):
    # Some templates wrap assistant text in {% generation %} ... {% endgeneration %}; the text renders unchanged.
    tags = {"generation"}  # noqa: RUF012 - jinja's declared interface

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    import json

    # Jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound."""

    def __init__(self, source: str, tokenizer: TokenizerInfo) -> None:
        """Compile `source`; a template that does not parse is a ChatError."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template of {tokenizer.path.parent} does not compile: {e}") from None
        self.variables = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token}

    @classmethod
    def of(cls, tokenizer: TokenizerInfo) -> ChatTemplate:
        """The tokenizer's template; a tokenizer without one is a ChatError."""
        if tokenizer.chat_template is None:
            raise ChatError(
                f"tokenizer {tokenizer.path.parent} has no chat template (chat_template in tokenizer_config.json "
                "or a chat_template.jinja file), which `messages` data needs; add one, or use prompt/completion data"
            )
        return cls(tokenizer.chat_template, tokenizer)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as the template writes it."""
        try:
            return self.template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.variables
            )
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template failed: {e}") from None

    def spans(self, messages: Sequence[dict[str, Any]]) -> tuple[str, list[Span]]:
        """The rendered conversation and the character span of every turn (see the module docstring)."""
        text = self.render(messages)
        spans: list[Span] = []
        start = 0
        for i, message in enumerate(messages):
            end = len(self._prefix(messages, i + 1, text, False))
            loss_start = start
            if message["role"] == "assistant":
                loss_start = len(self._prefix(messages, i, text, True))
                if not start <= loss_start <= end:
                    raise ChatError(f"the chat template's generation prompt before turn {i} overlaps turn {i - 1}")
            spans.append(Span(message["role"], start, loss_start, end))
            start = end
        return text, spans

    def _prefix(self, messages: Sequence[dict[str, Any]], n: int, whole: str, generation_prompt: bool) -> str:
        if n == 0 and not generation_prompt:
            return ""
        part = self.render(messages[:n], add_generation_prompt=generation_prompt)
        if not whole.startswith(part):
            what = "with the generation prompt " if generation_prompt else ""
            raise ChatError(
                f"the chat template renders the first {n} turns {what}differently from how it renders them inside "
                "the whole conversation, so turn boundaries (and loss masks) cannot be found"
            )
        return part


def loss_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[Span], roles: Collection[str]) -> np.ndarray:
    """bool per token: its first character lies in the loss part of a turn whose role is in `roles`."""
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    loss = np.zeros(len(offsets), dtype=bool)
    for span in spans:
        if span.role in roles:
            loss |= (starts >= span.loss_start) & (starts < span.end)
    return loss


def encode_chat(
    tokenizer: TokenizerInfo, template: ChatTemplate, messages: Sequence[dict[str, Any]], roles: Collection[str]
) -> Tokens:
    """A conversation as tokens; the template writes any BOS itself, so the tokenizer adds no special tokens."""
    text, spans = template.spans(messages)
    enc = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return Tokens(np.asarray(enc.ids, dtype=np.int32), loss_from_spans(enc.offsets, spans, roles))


def encode_prompt_completion(tokenizer: TokenizerInfo, prompt: str, completion: str, roles: Collection[str]) -> Tokens:
    """Plain-text prompt (a `user` turn) and completion (an `assistant` turn, ended with EOS) as tokens.

    The prompt is encoded as pretraining text is (the tokenizer's post-processor may add a BOS), the completion
    without special tokens; the two are encoded apart so the boundary between them is exact."""
    tok = tokenizer.tokenizer
    head = tok.encode(prompt).ids
    tail = [*tok.encode(completion, add_special_tokens=False).ids, tokenizer.eos_id]
    ids = np.asarray([*head, *tail], dtype=np.int32)
    loss = np.concatenate([np.full(len(head), "user" in roles), np.full(len(tail), "assistant" in roles)])
    return Tokens(ids, loss.astype(bool))
