"""Local tokenizers: a folder with `tokenizer.json` (and `tokenizer_config.json`), or a `tokenizer.json` file.

Loaded with HF `tokenizers`, never from a hub. The special-token ids (BOS, EOS, pad) come from
`tokenizer_config.json` when the folder has one, else from the usual token names. The chat template is the
folder's `chat_template.jinja` file, else the `chat_template` entry of `tokenizer_config.json` (where transformers
keeps it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks a token lmforge needs; the message names the path."""


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and the facts the trainer takes from it."""

    path: Path
    """The tokenizer.json file."""
    tokenizer: Tokenizer
    """The HF `tokenizers` object."""
    eos_id: int
    """End-of-sequence id: ends every document in token shards."""
    bos_id: int | None
    """Beginning-of-sequence id, if the tokenizer has one."""
    pad_id: int | None
    """Padding id, if the tokenizer has one."""
    chat_template: str | None = None
    """The Jinja chat template that renders a list of messages as text, if the tokenizer has one."""

    @property
    def size(self) -> int:
        """Number of token ids, added tokens included (len(tokenizer))."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str:
        """The EOS token's text."""
        return str(self.tokenizer.id_to_token(self.eos_id))

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, if the tokenizer has one."""
        return None if self.bos_id is None else str(self.tokenizer.id_to_token(self.bos_id))


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find(tok: Tokenizer, configured: str | None, names: tuple[str, ...]) -> int | None:
    for name in (configured,) if configured else names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    return None


def load_tokenizer(name: str | Path) -> TokenizerInfo:
    """Load a local tokenizer folder or tokenizer.json file."""
    path = Path(name)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"tokenizer {name}: no tokenizer.json there (tokenizers are loaded from local files only)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:
        raise TokenizerError(f"tokenizer {file}: cannot be loaded: {e}") from None
    config: dict[str, object] = {}
    config_file = file.parent / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
    eos = _find(tok, _token_text(config.get("eos_token")), _EOS_NAMES)
    if eos is None:
        raise TokenizerError(
            f"tokenizer {file}: no EOS token found (set eos_token in {config_file.name} or use one of {_EOS_NAMES})"
        )
    bos = _find(tok, _token_text(config.get("bos_token")), _BOS_NAMES)
    pad = _find(tok, _token_text(config.get("pad_token")), _PAD_NAMES)
    return TokenizerInfo(file, tok, eos, bos, pad, _chat_template(file.parent, config))


def _chat_template(folder: Path, config: dict[str, object]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default" renders plain conversations
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
