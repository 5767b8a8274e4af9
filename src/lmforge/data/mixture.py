"""Data mixtures written by `lmforge mix`: the manifest of a pool and the per-document source file.

A mixture pool is an ordinary token-shard folder (`mix.ds`, `.ds.index`, `.ds.metadata`, optionally `.ds.loss`)
plus two files that shard readers ignore:

- `mix.ds.source`: one uint8 per document of `mix.ds`, aligned with `mix.ds.index`, holding the position (in the
  manifest's source list) of the source that document was taken from. With the index it attributes any token
  range of the pool to its sources.
- `mix.json`: the manifest, `MixManifest`: what was asked for, what was written per source, and a fingerprint of
  each source folder (file names, sizes, token and document counts) so that a later check can tell whether a
  source changed since.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.shards import ShardFile, list_shards, open_shard

MANIFEST_NAME = "mix.json"
"""File name of the manifest inside a pool folder."""
SOURCE_SUFFIX = ".source"
"""Appended to a `.ds` file's name for its per-document source ids (`mix.ds` -> `mix.ds.source`)."""
MANIFEST_FORMAT = 1
"""The manifest layout `write_manifest` writes and `read_manifest` accepts."""
MAX_SOURCES = 255
"""Source ids are one byte each."""


class MixError(ValueError):
    """A mixture that cannot be written or read as asked; the message names the source, flag or file at fault."""


@dataclass(frozen=True)
class MixSource:
    """One source of a pool: what it was asked to contribute and what it did."""

    name: str
    """Label of the source (`^[A-Za-z0-9_.-]+$`); metric keys use it, e.g. `data/source/<name>/tokens`."""
    path: str
    """The source's shard folder, as it was given (relative paths are relative to where the mix ran)."""
    weight: float
    """The weight given; only its ratio to the other weights matters."""
    target_share: float
    """`weight` divided by the sum of all weights: the share of the pool's tokens asked of this source."""
    target_tokens: int
    """`target_share` times the tokens requested, rounded."""
    tokens: int
    """Tokens written from this source."""
    documents: int
    """Documents written from this source (a document repeated across passes counts each time)."""
    repeats: float
    """Written tokens divided by the source's tokens: passes over the source (1.0 = every token once)."""
    fingerprint: dict[str, Any]
    """`source_fingerprint` of the folder when the pool was written."""


@dataclass(frozen=True)
class MixManifest:
    """The contents of `mix.json`."""

    format: int
    """Manifest layout version (`MANIFEST_FORMAT`)."""
    seed: int
    """Seed of the document orders of every source and of the interleaving."""
    tokens_requested: int
    """Pool size asked for, in tokens."""
    tokens: int
    """Tokens written (the request within one document per source)."""
    documents: int
    """Documents written."""
    max_repeats: float
    """Most passes over any one source that were allowed."""
    command: tuple[str, ...]
    """The command line that wrote the pool (empty when it was written through the library)."""
    tokenizer: str
    """Line 1 of the sources' `.ds.metadata`, `tokenizer|token_size`, shared by every source and the pool."""
    token_size: int
    """Bytes per token: 2 (uint16) or 4 (uint32)."""
    files: tuple[str, ...]
    """The pool's `.ds` files, relative to its folder; each has a `SOURCE_SUFFIX` file beside it."""
    sources: tuple[MixSource, ...]
    """The sources, in the order of their ids in the `.source` files."""

    @property
    def source_names(self) -> tuple[str, ...]:
        """The sources' names, indexed by source id."""
        return tuple(s.name for s in self.sources)

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON-ready values (tuples become lists)."""
        data = asdict(self)
        data["command"] = list(self.command)
        data["files"] = list(self.files)
        data["sources"] = [asdict(s) for s in self.sources]
        return data


_SOURCE_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "path": str,
    "weight": (int, float),
    "target_share": (int, float),
    "target_tokens": int,
    "tokens": int,
    "documents": int,
    "repeats": (int, float),
    "fingerprint": dict,
}
_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "seed": int,
    "tokens_requested": int,
    "tokens": int,
    "documents": int,
    "max_repeats": (int, float),
    "command": list,
    "tokenizer": str,
    "token_size": int,
    "files": list,
    "sources": list,
}


def _checked(data: Any, types: dict[str, type | tuple[type, ...]], where: str) -> dict[str, Any]:
    """`data` if it is an object holding exactly the keys of `types` with values of those types."""
    if not isinstance(data, dict):
        raise MixError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = sorted(set(types) - set(data))
    extra = sorted(set(data) - set(types))
    if missing or extra:
        raise MixError(f"{where}: missing keys {missing}, unknown keys {extra}")
    for key, kind in types.items():
        # bool is an int to isinstance, but never a valid count or weight here.
        if isinstance(data[key], bool) or not isinstance(data[key], kind):
            raise MixError(f"{where}: '{key}' has the wrong type ({type(data[key]).__name__})")
    return data


def _source_from_json(data: Any, where: str) -> MixSource:
    d = _checked(data, _SOURCE_TYPES, where)
    floats = {k: float(d[k]) for k in ("weight", "target_share", "repeats")}
    return MixSource(**{**d, **floats})


def manifest_from_json(data: Any, where: str) -> MixManifest:
    """A manifest from parsed JSON; `MixError` naming `where` when a key is missing, unknown or mistyped."""
    d = _checked(data, _MANIFEST_TYPES, where)
    if d["format"] != MANIFEST_FORMAT:
        raise MixError(f"{where}: manifest format {d['format']}, this version of lmforge reads {MANIFEST_FORMAT}")
    if not all(isinstance(x, str) for x in d["command"] + d["files"]):
        raise MixError(f"{where}: 'command' and 'files' must be lists of strings")
    if not d["files"]:
        raise MixError(f"{where}: 'files' is empty")
    if not 1 <= len(d["sources"]) <= MAX_SOURCES:
        raise MixError(f"{where}: {len(d['sources'])} sources, expected 1 to {MAX_SOURCES}")
    sources = tuple(_source_from_json(s, f"{where}: sources[{i}]") for i, s in enumerate(d["sources"]))
    return MixManifest(
        format=d["format"],
        seed=d["seed"],
        tokens_requested=d["tokens_requested"],
        tokens=d["tokens"],
        documents=d["documents"],
        max_repeats=float(d["max_repeats"]),
        command=tuple(d["command"]),
        tokenizer=d["tokenizer"],
        token_size=d["token_size"],
        files=tuple(d["files"]),
        sources=sources,
    )


def read_manifest(folder: Path) -> MixManifest | None:
    """The manifest of the pool in `folder`; None when the folder has no `mix.json`, `MixError` naming the file
    when it is not a valid manifest."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MixError(f"{path}: not valid JSON: {e}") from None
    return manifest_from_json(data, str(path))


def write_manifest(folder: Path, manifest: MixManifest) -> Path:
    """Write `manifest` as `folder/mix.json` (indented, keys in field order, so equal manifests give equal bytes);
    returns the file's path."""
    path = Path(folder) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    return path


def source_ids_path(shard_path: Path) -> Path:
    """The per-document source-id file of a `.ds` file: `NAME.ds.source`."""
    return shard_path.with_name(shard_path.name + SOURCE_SUFFIX)


def open_source_ids(shard_path: Path) -> np.ndarray:
    """Memory-map the uint8 source id of every document of the `.ds` file `shard_path`.

    The file must hold one byte per entry of `NAME.ds.index`; `MixError` naming the file otherwise. Ids are not
    checked against a manifest here (that would read the whole file); `lmforge mix --verify` does.
    """
    path = source_ids_path(Path(shard_path))
    index = Path(shard_path).with_name(Path(shard_path).name + ".index")
    if not path.is_file():
        raise MixError(f"{path}: source id file is missing")
    if not index.is_file():
        raise MixError(f"{path}: document index {index.name} is missing")
    documents = index.stat().st_size // 8
    size = path.stat().st_size
    if size != documents or documents == 0:
        raise MixError(f"{path}: {size} bytes, expected one per document of {index.name} ({documents})")
    return np.memmap(path, dtype=np.uint8, mode="r")


def files_fingerprint(files: Sequence[ShardFile]) -> dict[str, Any]:
    """The fingerprint of open shard files: `{"files": [{"name", "bytes", "tokens", "documents"}], "tokens",
    "documents"}`, files in the order given (a folder's are sorted by name)."""
    entries = [
        {"name": f.path.name, "bytes": f.path.stat().st_size, "tokens": f.num_tokens, "documents": f.num_docs}
        for f in files
    ]
    return {
        "files": entries,
        "tokens": sum(e["tokens"] for e in entries),
        "documents": sum(e["documents"] for e in entries),
    }


def source_fingerprint(folder: Path) -> dict[str, Any]:
    """What identifies a source folder cheaply: `files_fingerprint` of its `.ds` files (name, byte size, tokens and
    documents of each, and the totals).

    Sizes and counts, not a content hash: hashing would read every byte of sources that may be terabytes. Raises
    `ShardError` when the folder is not readable as token shards.
    """
    return files_fingerprint([open_shard(p) for p in list_shards(Path(folder))])
