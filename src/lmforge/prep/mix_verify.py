"""`lmforge mix --verify`: recount a pool's tokens and documents per source and check them against its manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.data.mixture import (
    MANIFEST_NAME,
    MixError,
    MixManifest,
    MixSource,
    open_source_ids,
    read_manifest,
    source_fingerprint,
    source_ids_path,
)
from lmforge.data.shards import ShardError, open_shard
from lmforge.prep.mix import metadata_line


@dataclass(frozen=True)
class MixCheck:
    """What `verify_mix` counted in a pool."""

    manifest: MixManifest
    """The pool's manifest."""
    tokens: tuple[int, ...]
    """Tokens per source, recounted from the `.source` and `.index` files."""
    documents: tuple[int, ...]
    """Documents per source, recounted."""
    warnings: tuple[str, ...]
    """Sources whose folder changed since the pool was written, or could not be checked."""


def _count_file(path: Path, manifest: MixManifest) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(tokens per source, documents per source, tokens, documents) of one `.ds` file of the pool."""
    if not path.is_file():
        raise MixError(f"{path}: missing, but {MANIFEST_NAME} lists it")
    shard = open_shard(path)
    line = metadata_line(shard)
    if line != manifest.tokenizer:
        raise MixError(f"{path}.metadata: tokenizer line {line!r}, {MANIFEST_NAME} says {manifest.tokenizer!r}")
    ids = open_source_ids(path)
    n = len(manifest.sources)
    tokens = np.zeros(n, dtype=np.int64)
    documents = np.zeros(n, dtype=np.int64)
    step = 1 << 20
    previous_end = 0
    for a in range(0, shard.num_docs, step):
        ends = shard.doc_ends[a : a + step].astype(np.int64)
        lengths = np.diff(ends, prepend=previous_end)
        previous_end = int(ends[-1])
        chunk = np.asarray(ids[a : a + step])
        top = int(chunk.max())
        if top >= n:
            where = a + int(np.argmax(chunk >= n))
            raise MixError(f"{source_ids_path(path)}: document {where} has source id {top}, {MANIFEST_NAME} lists {n}")
        tokens += np.bincount(chunk, weights=lengths, minlength=n).astype(np.int64)
        documents += np.bincount(chunk, minlength=n)
    return tokens, documents, shard.num_tokens, shard.num_docs


def _fingerprint_warning(source: MixSource) -> str | None:
    """A line saying how the source's folder changed since the pool was written, or None when it did not."""
    label = f"source {source.name} (folder {source.path})"
    if not Path(source.path).is_dir():
        return f"{label}: folder not found from here; its fingerprint was not checked"
    try:
        now = source_fingerprint(Path(source.path))
    except ShardError as e:
        return f"{label}: can no longer be read as token shards ({e})"
    if now == source.fingerprint:
        return None
    before = {f["name"]: f for f in source.fingerprint.get("files", [])}
    after = {f["name"]: f for f in now["files"]}
    changes = [f"{source.fingerprint.get('tokens', 0):,} -> {now['tokens']:,} tokens"]
    for what, names in (
        ("added", sorted(set(after) - set(before))),
        ("removed", sorted(set(before) - set(after))),
        ("changed", sorted(k for k in set(before) & set(after) if before[k] != after[k])),
    ):
        if names:
            changes.append(f"{what} {names[:3]}" + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
    return f"{label}: changed since the pool was written ({'; '.join(changes)})"


def verify_mix(folder: Path) -> MixCheck:
    """Recount a pool's tokens and documents per source from its `.source` and `.index` files and check them
    against its manifest; compare each source folder that still exists with its fingerprint.

    Raises `MixError` (or `ShardError`) naming the file when the pool is inconsistent; changed or missing source
    folders are not errors but come back as `warnings`.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise MixError(f"{folder}: not a folder")
    manifest = read_manifest(folder)
    if manifest is None:
        raise MixError(f"{folder}: no {MANIFEST_NAME}; not a pool written by lmforge mix")
    n = len(manifest.sources)
    tokens, documents = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    total_tokens = total_documents = 0
    for name in manifest.files:
        t, d, nt, nd = _count_file(folder / name, manifest)
        tokens += t
        documents += d
        total_tokens += nt
        total_documents += nd
    manifest_path = folder / MANIFEST_NAME
    if (total_tokens, total_documents) != (manifest.tokens, manifest.documents):
        raise MixError(
            f"{folder / manifest.files[0]}: the pool holds {total_tokens:,} tokens in {total_documents:,} documents, "
            f"{manifest_path} says {manifest.tokens:,} in {manifest.documents:,}"
        )
    for i, s in enumerate(manifest.sources):
        if (int(tokens[i]), int(documents[i])) != (s.tokens, s.documents):
            raise MixError(
                f"{source_ids_path(folder / manifest.files[0])}: source {s.name} has {int(tokens[i]):,} tokens in "
                f"{int(documents[i]):,} documents, {manifest_path} says {s.tokens:,} in {s.documents:,}"
            )
    warnings = [w for s in manifest.sources if (w := _fingerprint_warning(s)) is not None]
    return MixCheck(manifest, tuple(int(x) for x in tokens), tuple(int(x) for x in documents), tuple(warnings))
