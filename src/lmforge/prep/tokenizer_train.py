"""A byte-level BPE tokenizer trained with HF `tokenizers` on local text (`lmforge tokenizer train`).

The saved folder (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`) loads offline with
`lmforge.data.tokenizer.load_tokenizer` and with `transformers.AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from lmforge.prep.text_sources import SourceError, iter_file_documents, list_input_files

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Fixed order, so the special tokens get ids 0..4 in every tokenizer this command trains.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Every byte is a base token of a byte-level BPE, and the special tokens come on top.
MIN_VOCAB_SIZE = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts`; the special tokens get ids 0..4 in `SPECIAL_TOKENS` order.

    The vocabulary may end up smaller than `vocab_size` when the texts have fewer merges to offer.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size}: must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens)")
    if min_frequency < 1:
        raise ValueError(f"min_frequency {min_frequency}: must be at least 1")
    tok = Tokenizer(models.BPE())
    # No prefix space and no trimming, so decode(encode(text)) gives the text back byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes from the start: any text can be encoded, even bytes the corpus never shows.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """The `tokenizer_config.json` contents for a tokenizer from `train_bpe`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
        # BOS is not added by encode(); token shards end documents with EOS only.
        "add_bos_token": False,
        "add_eos_token": False,
        # Cleaning spaces before punctuation would break the exact decode round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer_folder(tok: Tokenizer, out_dir: Path, model_max_length: int = 2048) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `out_dir` (created)."""
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer lacks the special tokens {missing}; train it with train_bpe")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


class _Counted:
    """An iterable of document texts that counts the documents it has yielded."""

    def __init__(self, documents: Iterator[tuple[str, str]]) -> None:
        self._documents = documents
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        for _, text in self._documents:
            self.count += 1
            yield text


@dataclass(frozen=True)
class TrainedTokenizer:
    """What `train_tokenizer` wrote and read."""

    output: Path
    """The tokenizer folder."""
    vocab_size: int
    """The vocabulary size reached, special tokens included (at most the size asked for)."""
    files: int
    """Input files read."""
    documents: int
    """Documents read from them."""


def train_tokenizer(
    inputs: Sequence[Path],
    output: Path,
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    text_key: str = "text",
    model_max_length: int = 2048,
    overwrite: bool = False,
) -> TrainedTokenizer:
    """Train a byte-level BPE (`train_bpe`) on the documents of `inputs` and save it as a tokenizer folder
    (`save_tokenizer_folder`) in `output`.

    The output folder and the options are checked before any input is read; a non-empty `output` is refused
    unless `overwrite`, which writes the tokenizer files into it and leaves its other files alone. Nothing is
    written when the inputs hold no document. Raises `SourceError` for bad input.
    """
    # Messages name the command-line option of each value: `lmforge tokenizer train` passes them through as they are.
    if output.exists() and not output.is_dir():
        raise SourceError(f"--output {output}: exists and is not a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise SourceError(f"--output {output}: folder is not empty (pass --overwrite to write into it)")
    if vocab_size < MIN_VOCAB_SIZE:
        raise SourceError(f"--vocab-size {vocab_size}: must be at least {MIN_VOCAB_SIZE}")
    if min_frequency < 1:
        raise SourceError(f"--min-frequency {min_frequency}: must be at least 1")
    if model_max_length < 1:
        raise SourceError(f"--model-max-length {model_max_length}: must be positive")
    files = list_input_files(list(inputs))
    texts = _Counted(doc for file in files for doc in iter_file_documents(file, text_key))
    tok = train_bpe(texts, vocab_size, min_frequency)
    if texts.count == 0:
        raise SourceError("the inputs hold no text")
    save_tokenizer_folder(tok, output, model_max_length)
    return TrainedTokenizer(output, tok.get_vocab_size(with_added_tokens=True), len(files), texts.count)
