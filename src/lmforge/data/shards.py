"""Token shards as datatrove's `DocumentTokenizer` writes them, read with `numpy.memmap`.

A folder holds, per shard, `NAME.ds` (little-endian token ids, no header), `NAME.ds.index` (uint64 END offset of
every document, in tokens; the last one is the token count), `NAME.ds.metadata` (line 1 `tokenizer|token_size`,
line 2 the token count) and optionally `NAME.ds.loss` (one byte per token: 1 where the token is a loss target).
Nothing is read whole: tokens stay memory-mapped and are sliced per window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class ShardError(ValueError):
    """A shard file or folder that cannot be read as token shards; the message names the file."""


@dataclass(frozen=True)
class ShardFile:
    """One memory-mapped `.ds` file with its document index and optional loss mask."""

    path: Path
    """The `.ds` file."""
    tokens: np.ndarray
    """Memory-mapped token ids (uint16 or uint32)."""
    doc_ends: np.ndarray
    """Memory-mapped uint64 document END offsets; read slices with `.astype(np.int64)`."""
    loss: np.ndarray | None
    """Memory-mapped uint8 per-token loss flags, when a `.ds.loss` file exists."""
    tokenizer: str
    """Tokenizer name recorded in the metadata."""

    @property
    def num_tokens(self) -> int:
        """Tokens in the file."""
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        """Documents in the file."""
        return int(self.doc_ends.shape[0])


def _read_metadata(path: Path) -> tuple[str, int, int]:
    meta = path.with_name(path.name + ".metadata")
    if not meta.is_file():
        raise ShardError(f"{path}: metadata file {meta.name} is missing")
    lines = meta.read_text(encoding="utf-8").splitlines()
    try:
        tokenizer, size = lines[0].rsplit("|", 1)
        token_size, count = int(size), int(lines[1])
    except (IndexError, ValueError):
        raise ShardError(f"{meta}: expected 'tokenizer|token_size' then the token count, got {lines[:2]}") from None
    if token_size not in _DTYPES:
        raise ShardError(f"{meta}: token_size {token_size} is not 2 (uint16) or 4 (uint32)")
    return tokenizer, token_size, count


def open_shard(path: Path) -> ShardFile:
    """Memory-map one `.ds` file and check that its size, metadata and index agree."""
    tokenizer, token_size, count = _read_metadata(path)
    nbytes = path.stat().st_size
    if nbytes % token_size:
        raise ShardError(f"{path}: {nbytes} bytes is not a multiple of the token size {token_size} (truncated file?)")
    if nbytes // token_size != count:
        raise ShardError(f"{path}: holds {nbytes // token_size} tokens but its metadata says {count}")
    if count == 0:
        raise ShardError(f"{path}: holds no tokens")
    index_path = path.with_name(path.name + ".index")
    if not index_path.is_file():
        raise ShardError(f"{path}: document index {index_path.name} is missing")
    if index_path.stat().st_size % 8 or index_path.stat().st_size == 0:
        raise ShardError(f"{index_path}: size {index_path.stat().st_size} is not a positive multiple of 8 bytes")
    tokens = np.memmap(path, dtype=_DTYPES[token_size], mode="r")
    doc_ends = np.memmap(index_path, dtype=np.uint64, mode="r")
    last = int(doc_ends[-1])
    if last != count:
        raise ShardError(f"{index_path}: last document ends at {last} but {path.name} holds {count} tokens")
    ends = doc_ends.astype(np.int64)
    gaps = np.diff(ends, prepend=0)
    if (gaps == 0).any():
        empty = int(np.argmax(gaps == 0))
        raise ShardError(f"{index_path}: document {empty} is empty (its end offset {int(ends[empty])} repeats the one "
                         "before); a tokenizer writes no empty documents, so the index is damaged")  # fmt: skip
    if np.any(gaps < 0):
        raise ShardError(f"{index_path}: document end offsets are not strictly increasing from above 0")
    loss = None
    loss_path = path.with_name(path.name + ".loss")
    if loss_path.is_file():
        if loss_path.stat().st_size != count:
            raise ShardError(f"{loss_path}: {loss_path.stat().st_size} bytes, expected one per token ({count})")
        loss = np.memmap(loss_path, dtype=np.uint8, mode="r")
    return ShardFile(path, tokens, doc_ends, loss, tokenizer)


def list_shards(folder: Path) -> list[Path]:
    """The `.ds` files directly in `folder`, sorted by name."""
    if not folder.is_dir():
        raise ShardError(f"data path {folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix == ".ds" and p.is_file())
    if not files:
        raise ShardError(f"data path {folder} holds no .ds token shards")
    return files


class ShardPool:
    """Folders of shards read as one token stream: folder order, then file order."""

    def __init__(self, folders: Sequence[str | Path]) -> None:
        self.files = [open_shard(p) for folder in folders for p in list_shards(Path(folder))]
        sizes = np.array([f.num_tokens for f in self.files], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        """Pool offset of each file's first token (and the pool size last)."""
        self.has_loss = any(f.loss is not None for f in self.files)

    @property
    def num_tokens(self) -> int:
        """Tokens in the pool."""
        return int(self.starts[-1])

    def locate(self, offset: int) -> tuple[ShardFile, int]:
        """The file holding pool offset `offset` and the offset inside it."""
        i = int(np.searchsorted(self.starts, offset, side="right")) - 1
        return self.files[i], offset - int(self.starts[i])

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Tokens [start, start + length) of the pool as int64, the pool offsets where documents start strictly
        inside that span, and the loss flags (None when no file has them)."""
        end = start + length
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, loss_parts, doc_starts = [], [], []
        i = first
        while int(self.starts[i]) < end:
            f, base = self.files[i], int(self.starts[i])
            lo, hi = max(start - base, 0), min(end - base, f.num_tokens)
            parts.append(f.tokens[lo:hi])
            if self.has_loss:
                loss_parts.append(f.loss[lo:hi] if f.loss is not None else np.ones(hi - lo, dtype=np.uint8))
            # A document ends at each index entry; the next one starts there (file ends included).
            k0 = int(np.searchsorted(f.doc_ends, np.uint64(lo), side="right"))
            k1 = int(np.searchsorted(f.doc_ends, np.uint64(hi), side="left"))
            doc_starts.append(f.doc_ends[k0:k1].astype(np.int64) + base)
            if hi == f.num_tokens and base + hi < end:
                doc_starts.append(np.array([base + hi], dtype=np.int64))
            i += 1
        tokens = np.concatenate(parts).astype(np.int64)
        loss = np.concatenate(loss_parts) if self.has_loss else None
        return tokens, np.concatenate(doc_starts), loss
