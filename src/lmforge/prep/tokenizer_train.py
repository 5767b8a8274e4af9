"""`lmforge tokenizer train`: a byte-level BPE tokenizer trained with HF `tokenizers` on local text.

The saved folder (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`) loads offline with
`lmforge.data.tokenizer.load_tokenizer` and with `transformers.AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from lmforge.prep.command import parse_args, usage_error
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge tokenizer train",
        description="Train a byte-level BPE tokenizer on local text (.txt/.md files, folders, .jsonl, .parquet).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="text files, folders of them, .jsonl or .parquet files")
    parser.add_argument("--output", type=Path, required=True, help="folder to write the tokenizer into")
    parser.add_argument("--vocab-size", type=int, default=8192, help="target vocabulary size (default 8192)")
    parser.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merged pair (default 2)")
    parser.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--model-max-length", type=int, default=2048, help="model_max_length in tokenizer_config")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty output folder")
    return parser


def _error(message: str) -> int:
    return usage_error("lmforge tokenizer train", message)


def tokenizer_main(argv: list[str]) -> int:
    """Run `lmforge tokenizer train` with the arguments after `train`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    out: Path = args.output
    if out.exists() and not out.is_dir():
        return _error(f"--output {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        return _error(f"--output {out}: folder is not empty (pass --overwrite to write into it)")
    if args.vocab_size < MIN_VOCAB_SIZE:
        return _error(f"--vocab-size {args.vocab_size}: must be at least {MIN_VOCAB_SIZE}")
    if args.min_frequency < 1:
        return _error(f"--min-frequency {args.min_frequency}: must be at least 1")
    if args.model_max_length < 1:
        return _error(f"--model-max-length {args.model_max_length}: must be positive")
    try:
        files = list_input_files(args.inputs)
        texts = _Counted(doc for file in files for doc in iter_file_documents(file, args.text_key))
        tok = train_bpe(texts, args.vocab_size, args.min_frequency)
    except SourceError as e:
        return _error(str(e))
    if texts.count == 0:
        return _error("the inputs hold no text")
    save_tokenizer_folder(tok, out, args.model_max_length)
    print(
        f"tokenizer: vocab {tok.get_vocab_size(with_added_tokens=True)} (asked {args.vocab_size}), "
        f"{len(files)} files, {texts.count} documents -> {out}"
    )
    return 0
