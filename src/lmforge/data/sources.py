"""Which source every token of a pool comes from, so training can count the tokens it consumes per source.

A folder written by `lmforge mix` names its sources in `mix.json` and gives each document a source id in
`NAME.ds.source` (`lmforge.data.mixture`); a folder of `data.paths` without a manifest counts as one source named
after the folder. Sources of the same name in several folders are one source. Counting a token range reads only
the document index entries and source ids of the documents it overlaps, so a window costs a few small numpy
operations in the data worker and nothing on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.data.mixture import MixError, open_source_ids, read_manifest
from lmforge.data.shards import ShardPool, list_shards


class SourceMap:
    """Source ids of the documents of a `ShardPool`, and token counts per source over any range of it."""

    names: tuple[str, ...]
    """The sources, in the order of the counts: each manifest's sources in folder order, then folder names."""

    def __init__(self, pool: ShardPool, folders: Sequence[Path]) -> None:
        """Map every file of `pool` (opened from `folders`, in that order) to its sources."""
        self.pool = pool
        names: dict[str, int] = {}
        # Per file: a source id for the whole file (int), or the file's per-document ids with their global ids.
        self._files: list[int | tuple[np.ndarray, np.ndarray]] = []
        for folder in folders:
            paths = list_shards(Path(folder))
            manifest = read_manifest(Path(folder))
            if manifest is None:
                whole = names.setdefault(Path(folder).resolve().name, len(names))
                self._files += [whole] * len(paths)
                continue
            mapping = np.array([names.setdefault(n, len(names)) for n in manifest.source_names], dtype=np.int64)
            for path in paths:
                if path.name not in manifest.files:
                    raise MixError(f"{path}: not among the files of {Path(folder) / 'mix.json'} {list(manifest.files)}")
                self._files.append((open_source_ids(path), mapping))
        if len(self._files) != len(pool.files):
            raise MixError(f"data.paths changed while they were read: {len(pool.files)} files, {len(self._files)} now")
        self.names = tuple(names)

    @classmethod
    def for_pool(cls, pool: ShardPool, folders: Sequence[Path]) -> SourceMap | None:
        """The map of a pool with at least one mixture folder; None when no folder has a `mix.json`."""
        if not any(read_manifest(Path(f)) is not None for f in folders):
            return None
        return cls(pool, folders)

    def count(self, start: int, length: int) -> np.ndarray:
        """int64 tokens per source (in `names` order) among pool positions [start, start + length)."""
        out = np.zeros(len(self.names), dtype=np.int64)
        end = start + length
        starts = self.pool.starts
        i = int(np.searchsorted(starts, start, side="right")) - 1
        while i < len(self.pool.files) and int(starts[i]) < end:
            f, base = self.pool.files[i], int(starts[i])
            lo, hi = max(start - base, 0), min(end - base, f.num_tokens)
            source = self._files[i]
            if isinstance(source, int):
                out[source] += hi - lo
            else:
                ids, mapping = source
                # Document k spans [doc_ends[k - 1], doc_ends[k]): the first and last overlapped ones.
                k0 = int(np.searchsorted(f.doc_ends, np.uint64(lo), side="right"))
                k1 = int(np.searchsorted(f.doc_ends, np.uint64(hi - 1), side="right"))
                ends = np.minimum(f.doc_ends[k0 : k1 + 1].astype(np.int64), hi)
                lens = ends - np.concatenate([[lo], ends[:-1]])
                np.add.at(out, mapping[ids[k0 : k1 + 1]], lens)
            i += 1
        return out

    def source_of(self, file: int, doc: int) -> str:
        """The source name of document `doc` of the pool's file number `file`."""
        source = self._files[file]
        if isinstance(source, int):
            return self.names[source]
        ids, mapping = source
        return self.names[int(mapping[int(ids[doc])])]

    def document_sources(self) -> np.ndarray:
        """int64 source index of every document of the pool, in pool order (a file's end also ends a document)."""
        parts = []
        for f, source in zip(self.pool.files, self._files, strict=True):
            if isinstance(source, int):
                parts.append(np.full(f.num_docs, source, dtype=np.int64))
            else:
                ids, mapping = source
                parts.append(mapping[np.asarray(ids)])
        return np.concatenate(parts)
