"""Writing a mixture pool's files (`lmforge mix`): documents of many memory-mapped source files gathered in pool
order, chunk by chunk, and appended to `mix.ds`, `.ds.index`, `.ds.source` (and `.ds.loss`) by a writer thread.

Nothing is read whole: a chunk holds about `CHUNK_TOKENS` tokens, so memory grows with the number of documents
(their tables), not with the tokens.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lmforge.data.mixture import source_ids_path
from lmforge.data.shards import ShardFile

POOL_FILE = "mix.ds"
"""Name of the pool's one shard file."""
CHUNK_TOKENS = 1 << 20
"""Tokens gathered per chunk at most (unless one document is longer). Measured on the 2-core machine: with 1M
tokens the index arrays of an indexed gather stay in the CPU caches, about 1.5x faster than with 8M."""
CHUNK_DOCS = 4096
"""Documents gathered per chunk at most. Joining slices makes a Python object per document: measured on the 2-core
VM, 1M-token chunks of 16-token documents (65K objects) ran 3.7x slower per document than chunks of 4K documents,
most likely because the allocator maps fresh memory for each large chunk (first-touched memory is slow there)."""
INDEXED_BELOW = 100
"""Mean document length (tokens) of a chunk below which it is gathered with index arrays rather than slices."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)
"""Linux's flag for writes that bypass the page cache (0 where the system has none)."""
_DIRECT_ALIGN = 4096
"""Direct writes are whole multiples of this many bytes, from page-aligned memory."""
_Data = bytes | np.ndarray
"""What the gatherer hands the writer: joined slices or a filled array."""


def concat_ranges(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fill `out` (int64, sum(lengths) long) with the concatenation of `arange(s, s + n)` over (s, n) in
    (starts, lengths), every n > 0: ones, with a jump at each range's first element, summed up. Returns `out`."""
    if out.size == 0:
        return out
    out.fill(1)
    firsts = np.cumsum(lengths) - lengths
    out[0] = starts[0]
    out[firsts[1:]] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.cumsum(out, out=out)


class _Buffers:
    """Work arrays reused from chunk to chunk, grown when a chunk needs more. Fresh arrays of a few MB would be new
    memory maps, page-faulted in again on every chunk."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, key: str, size: int, dtype: np.dtype | type) -> np.ndarray:
        """The first `size` elements of the array kept under `key` (contents undefined)."""
        array = self._arrays.get(key)
        if array is None or array.size < size:
            array = self._arrays[key] = np.empty(max(size, 1), dtype=dtype)
        return array[:size]


class Gatherer:
    """Copies documents of many memory-mapped files, in a given order, into contiguous output buffers.

    Two ways, chosen per chunk by its mean document length. CPU time per output byte, measured on the project's
    2-core VM (documents of lognormal length, in random order, from 200 MB of sources):

    - slices: the documents' byte ranges joined with `bytes.join` over memoryviews of the files; a fixed cost per
      document (a Python slice and, most likely, a cache and TLB miss at a random place in the file) plus the
      copy: 210 MB/s at a mean of 64 tokens per document, 430 MB/s at 128, 1.7 GB/s at 200;
    - indexed: one int64 source index per token built with cumsum arithmetic, a `take` per file and one scatter
      into pool order: 190 MB/s at 16 tokens, 340 MB/s at 64, 430 MB/s at 128 and little more for longer ones.

    Indexed is the faster below about `INDEXED_BELOW` tokens per document.
    """

    def __init__(self, files: Sequence[ShardFile]) -> None:
        self.dtype = files[0].tokens.dtype
        """Token dtype of every file and of the pool."""
        # Plain ndarray views of the memmaps: indexing a memmap object costs more.
        self.tokens = [f.tokens.view(np.ndarray) for f in files]
        """Token array of each file."""
        has_loss = any(f.loss is not None for f in files)
        self.loss = [None if f.loss is None else f.loss.view(np.ndarray) for f in files] if has_loss else None
        """Loss flags of each file (None for files without), or None when no file has them."""
        counts = [f.num_docs for f in files]
        self.doc_file = np.repeat(np.arange(len(files), dtype=np.int32), counts)
        """int32: file of each run-wide document number (documents are numbered file after file)."""
        self.doc_start = np.empty(sum(counts), dtype=np.int64)
        """int64: where each document starts in its file."""
        self.doc_len = np.empty(sum(counts), dtype=np.int64)
        """int64: tokens of each document."""
        at = 0
        for f, n in zip(files, counts, strict=True):
            ends = f.doc_ends.astype(np.int64)
            self.doc_start[at] = 0
            self.doc_start[at + 1 : at + n] = ends[:-1]
            np.subtract(ends, self.doc_start[at : at + n], out=self.doc_len[at : at + n])
            at += n
        self._token_bytes = [memoryview(t.view(np.uint8)) for t in self.tokens]
        self._loss_bytes = [None if x is None else memoryview(x) for x in self.loss] if self.loss else None
        longest = int(self.doc_len.max()) if self.loss is not None and self.doc_len.size else 0
        self._ones = memoryview(np.ones(longest, dtype=np.uint8))
        """Loss flags of the documents of files without a loss file."""

    def gather(self, docs: np.ndarray, work: _Buffers, slot: int) -> tuple[_Data, _Data | None]:
        """Tokens (and loss flags) of run-wide documents `docs`, concatenated in that order. Arrays may live in
        `work`'s output slot `slot`: they stay valid until that slot is gathered into again."""
        if docs.size and self.doc_len[docs].mean() < INDEXED_BELOW:
            return self._indexed(docs, work, slot)
        return self._slices(docs)

    def _slices(self, docs: np.ndarray) -> tuple[_Data, _Data | None]:
        files = self.doc_file[docs].tolist()
        starts, lengths = self.doc_start[docs], self.doc_len[docs]
        size = self.dtype.itemsize
        views = self._token_bytes
        begin, end = (starts * size).tolist(), ((starts + lengths) * size).tolist()
        tokens = b"".join([views[f][a:b] for f, a, b in zip(files, begin, end, strict=True)])
        if self._loss_bytes is None:
            return tokens, None
        flags, ones = self._loss_bytes, self._ones
        begin, end = starts.tolist(), (starts + lengths).tolist()
        loss = b"".join(
            [ones[: b - a] if flags[f] is None else flags[f][a:b] for f, a, b in zip(files, begin, end, strict=True)]
        )
        return tokens, loss

    def _indexed(self, docs: np.ndarray, work: _Buffers, slot: int) -> tuple[np.ndarray, np.ndarray | None]:
        files, lengths = self.doc_file[docs], self.doc_len[docs]
        total = int(lengths.sum())
        out_starts = np.cumsum(lengths) - lengths
        # Group the documents by file, gather each group from its file into a staging array with one `take`, then
        # put everything in pool order with one scatter.
        order = np.argsort(files, kind="stable")
        files, lengths = files[order], lengths[order]
        src = concat_ranges(self.doc_start[docs][order], lengths, work.get("src", total, np.int64))
        dst = concat_ranges(out_starts[order], lengths, work.get("dst", total, np.int64))
        doc_cuts = np.concatenate([[0], np.flatnonzero(np.diff(files)) + 1, [files.size]])
        tok_cuts = np.concatenate([[0], np.cumsum(lengths)])[doc_cuts].tolist()
        groups = [(int(files[d]), a, b) for d, a, b in zip(doc_cuts[:-1], tok_cuts[:-1], tok_cuts[1:], strict=True)]
        stage = work.get("stage", total, self.dtype)
        for f, a, b in groups:
            # mode="clip": with "raise", numpy buffers `out` (the indices are in range by construction).
            np.take(self.tokens[f], src[a:b], out=stage[a:b], mode="clip")
        out = work.get(f"tokens{slot}", total, self.dtype)
        out[dst] = stage
        if self.loss is None:
            return out, None
        stage_loss = work.get("stage_loss", total, np.uint8)
        for f, a, b in groups:
            flags = self.loss[f]
            if flags is None:
                stage_loss[a:b] = 1
            else:
                np.take(flags, src[a:b], out=stage_loss[a:b], mode="clip")
        loss = work.get(f"loss{slot}", total, np.uint8)
        loss[dst] = stage_loss
        return out, loss


def _chunks(ends: np.ndarray, chunk_tokens: int, chunk_docs: int = CHUNK_DOCS) -> list[tuple[int, int]]:
    """[a, b) document ranges of the pool, from its document end offsets: each of at most `chunk_docs` documents
    and `chunk_tokens` tokens plus less than one document (a chunk is cut where the pool passes a multiple of
    `chunk_tokens`)."""
    total = int(ends[-1]) if ends.size else 0
    by_tokens = np.searchsorted(ends, np.arange(chunk_tokens, total, chunk_tokens), side="right")
    by_docs = np.arange(chunk_docs, ends.size, chunk_docs)
    bounds = np.unique(np.concatenate([[0], by_tokens, by_docs, [ends.size]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


class _AppendFile:
    """A new file written front to back through a page-aligned block buffer, with `O_DIRECT` where the file system
    takes it, else through the page cache.

    Why direct: on the project's VM, page-cache memory touched for the first time costs about 19 us per 4 KiB page,
    so buffered writes of a pool that does not fit in recycled memory ran at 150-270 MB/s, while direct writes of
    4 MiB blocks ran at 1.7 GB/s. A pool is written once and rarely read back at once, so skipping the cache
    costs nothing. tmpfs, some network file systems and other systems refuse `O_DIRECT` at open or at the first
    write; the file is then written buffered.
    """

    def __init__(self, path: Path, block: int = 4 << 20, direct: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        """Whether writes bypass the page cache (for now: a refused write turns it off)."""
        if direct and _O_DIRECT:
            with contextlib.suppress(OSError):
                self._fd = os.open(path, flags | _O_DIRECT, 0o644)
                self.direct = True
        if not self.direct:
            self._fd = os.open(path, flags, 0o644)
        self._buffer = mmap.mmap(-1, block)  # anonymous maps are page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self._filled = 0
        self.size = 0
        """Bytes written so far."""

    def write(self, data: _Data) -> None:
        """Append the bytes of `data` (a C-contiguous array or bytes)."""
        rest = memoryview(data).cast("B")
        while rest.nbytes:
            n = min(rest.nbytes, len(self._view) - self._filled)
            self._view[self._filled : self._filled + n] = rest[:n]
            self._filled += n
            self.size += n
            rest = rest[n:]
            if self._filled == len(self._view):
                self._flush(self._filled)

    def _flush(self, n: int) -> None:
        pending = self._view[:n]
        while pending.nbytes:
            try:
                done = os.write(self._fd, pending)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                # Opened with O_DIRECT but these writes are refused (alignment): go on through the page cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
                self.direct = False
                continue
            pending = pending[done:]
        pending.release()
        self._filled = 0

    def close(self) -> None:
        """Write what is left and close the file."""
        try:
            if self._filled and self.direct:
                # A direct write must be whole blocks: write the tail padded with zeros, then cut the file back.
                padded = -(-self._filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
                self._view[self._filled : padded] = bytes(padded - self._filled)
                self._flush(padded)
                os.ftruncate(self._fd, self.size)
            elif self._filled:
                self._flush(self._filled)
        finally:
            os.close(self._fd)
            self._view.release()
            self._buffer.close()


def _write_chunk(files: dict[str, _AppendFile], parts: dict[str, _Data]) -> None:
    for key, data in parts.items():
        files[key].write(data)


def write_pool(
    folder: Path, gatherer: Gatherer, docs: np.ndarray, labels: np.ndarray, metadata_line: str, chunk_tokens: int
) -> int:
    """Write mix.ds (+ .index, .metadata, .source, and .loss when the gatherer has loss flags) into `folder`;
    returns the tokens written.

    A writer thread writes chunk j while chunk j + 1 is gathered (two output slots, used in turn): writes that wait
    on the disk then overlap with the gathering instead of adding to it. Files are written by `_AppendFile`.
    """
    ends = np.cumsum(gatherer.doc_len[docs])
    path = folder / POOL_FILE
    names = {"tokens": path, "index": path.with_name(path.name + ".index"), "source": source_ids_path(path)}
    if gatherer.loss is not None:
        names["loss"] = path.with_name(path.name + ".loss")
    work = _Buffers()
    with contextlib.ExitStack() as stack:
        files = {key: _AppendFile(p) for key, p in names.items()}
        for f in files.values():
            stack.callback(f.close)
        writer = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-mix-writer"))
        pending: Future[None] | None = None
        for j, (a, b) in enumerate(_chunks(ends, chunk_tokens)):
            tokens, loss = gatherer.gather(docs[a:b], work, slot=j % 2)
            parts: dict[str, _Data] = {"tokens": tokens, "index": ends[a:b].astype("<u8"), "source": labels[a:b]}
            if loss is not None:
                parts["loss"] = loss
            if pending is not None:
                pending.result()  # the previous chunk is written: its slot is free for the next gather
            pending = writer.submit(_write_chunk, files, parts)
        if pending is not None:
            pending.result()
    total = int(ends[-1])
    path.with_name(path.name + ".metadata").write_text(f"{metadata_line}\n{total}\n", encoding="utf-8")
    return total
