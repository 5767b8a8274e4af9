"""Offline data mixtures (`lmforge mix`): one token pool drawn from several shard folders in chosen shares.

Source i is asked for T_i = N * w_i / sum(w) of the pool's N tokens. Its documents are taken whole, pass after
pass, each pass (epoch e) in the order of a permutation drawn from `numpy.random.default_rng([seed, i, e])`, until
its written tokens are as close to T_i as whole documents allow: within one document, so the shares of the pool
match the weights within one document per source. A source that would need more than `max_repeats` passes is
refused. The selected documents of all sources are then interleaved in a seeded random order (a permutation of
their source labels), so any window of the pool is a mixture, and written as one shard file `mix.ds` with
`mix.ds.source` (the source id of every document) and the manifest `mix.json` (see `lmforge.data.mixture`).

Tokens are never read whole: the sources stay memory-mapped and `lmforge.prep.pool_writer` gathers the pool in
chunks of at most `CHUNK_TOKENS` tokens, while a writer thread appends the previous chunk to the files. What is held
in memory grows with the number of documents (about 55 bytes each), not with the tokens. The pool is written into a
hidden sibling folder and renamed into place at the end, so an interrupted run never leaves a folder that looks
complete.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.data.mixture import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MAX_SOURCES,
    MixError,
    MixManifest,
    MixSource,
    files_fingerprint,
    write_manifest,
)
from lmforge.data.shards import ShardError, ShardFile, list_shards, open_shard
from lmforge.prep.pool_writer import CHUNK_TOKENS, POOL_FILE, Gatherer, write_pool

POOL_FILES = frozenset(
    [POOL_FILE, *(POOL_FILE + s for s in (".index", ".metadata", ".loss", ".source")), MANIFEST_NAME]
)
"""Every file a pool folder may hold; `--overwrite` replaces a folder only when it holds nothing else."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
"""Allowed source names: they become part of metric keys."""
ORDER_STREAM = 256
"""Stands for the source index in the seed of the interleaving order, `[seed, ORDER_STREAM, 0]`; above every
real source index, so it never repeats a source's stream."""


@dataclass(frozen=True)
class SourceSpec:
    """A source as asked for: `--source NAME=FOLDER:WEIGHT` or a `[[source]]` table."""

    name: str
    """Label of the source (`NAME_PATTERN`)."""
    path: str
    """Its shard folder, as given."""
    weight: float
    """Its weight, > 0; weights are normalized over all sources."""


@dataclass
class _Opened:
    """A source's shard files, memory-mapped."""

    spec: SourceSpec
    files: list[ShardFile]

    @property
    def documents(self) -> int:
        """Documents in the source."""
        return sum(f.num_docs for f in self.files)

    @property
    def tokens(self) -> int:
        """Tokens in the source."""
        return sum(f.num_tokens for f in self.files)

    @property
    def label(self) -> str:
        """How messages name the source."""
        return f"source {self.spec.name} (folder {self.spec.path})"


# ---------------------------------------------------------------------------------------------- checks


def _check_request(sources: Sequence[SourceSpec], tokens: int, seed: int, max_repeats: float) -> None:
    # Messages name the command-line flags: the command passes them through as they are.
    if not sources:
        raise MixError("no sources: give at least one --source NAME=FOLDER:WEIGHT")
    if len(sources) > MAX_SOURCES:
        raise MixError(f"{len(sources)} sources: at most {MAX_SOURCES} (source ids are one byte)")
    seen: set[str] = set()
    for s in sources:
        if not NAME_PATTERN.match(s.name):
            raise MixError(f"source name {s.name!r}: use only letters, digits, '_', '.' and '-'")
        if s.name in seen:
            raise MixError(f"source name {s.name!r} is given twice")
        seen.add(s.name)
        if not (math.isfinite(s.weight) and s.weight > 0):
            raise MixError(f"source {s.name}: weight {s.weight} must be a finite number above 0")
    if tokens < 1:
        raise MixError(f"--tokens {tokens}: must be at least 1")
    if seed < 0:
        raise MixError(f"--seed {seed}: must be 0 or more")
    if not (math.isfinite(max_repeats) and max_repeats >= 1):
        raise MixError(f"--max-repeats {max_repeats}: must be a number of at least 1")


def _check_output(output: Path, overwrite: bool, sources: Sequence[SourceSpec]) -> None:
    if output.exists() and not output.is_dir():
        raise MixError(f"--output {output}: exists and is not a folder")
    for s in sources:
        if Path(s.path).resolve() == output.resolve():
            raise MixError(f"--output {output}: is the folder of source {s.name}")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise MixError(f"--output {output}: folder is not empty (pass --overwrite to replace the pool in it)")
        foreign = sorted(e.name for e in output.iterdir() if e.name not in POOL_FILES)
        if foreign:
            raise MixError(
                f"--output {output}: holds files that are not part of a mix pool {foreign[:3]}; not replacing it"
            )


def _open_source(spec: SourceSpec) -> _Opened:
    """Open every shard file of the source (in name order, as `list_shards` gives them)."""
    try:
        return _Opened(spec, [open_shard(p) for p in list_shards(Path(spec.path))])
    except ShardError as e:
        raise MixError(f"source {spec.name}: {e}") from None


def metadata_line(f: ShardFile) -> str:
    return f"{f.tokenizer}|{f.tokens.dtype.itemsize}"


def _eos_id(f: ShardFile) -> int:
    return int(f.tokens[int(f.doc_ends[0]) - 1])


def _difference(a: str, b: str) -> str:
    """What differs between two metadata lines `tokenizer|token_size`."""
    (ta, sa), (tb, sb) = a.rsplit("|", 1), b.rsplit("|", 1)
    parts = []
    if ta != tb:
        parts.append(f"tokenizer {ta!r} vs {tb!r}")
    if sa != sb:
        parts.append(f"token size {sa} vs {sb} bytes")
    return " and ".join(parts)


def _check_one_tokenizer(sources: Sequence[_Opened]) -> tuple[str, int]:
    """The metadata line and EOS id every file of every source shares; `MixError` naming both sides of the first
    mismatch. The EOS id is the last token of each file's first document (every document ends with EOS)."""
    first = sources[0]
    line, eos = metadata_line(first.files[0]), _eos_id(first.files[0])
    for s in sources:
        for f in s.files:
            other = metadata_line(f)
            if other != line:
                raise MixError(
                    f"{s.label} and {first.label} were made with different tokenizers "
                    f"({_difference(other, line)}; metadata of {f.path.name}: {other!r}, of "
                    f"{first.files[0].path.name}: {line!r})"
                )
            found = _eos_id(f)
            if found != eos:
                raise MixError(
                    f"{s.label} and {first.label} end documents with different EOS ids: {found} in {f.path.name}, "
                    f"{eos} in {first.files[0].path.name}; the sources must come from one tokenizer"
                )
    return line, first.files[0].tokens.dtype.itemsize


def _check_repeats(sources: Sequence[_Opened], targets: Sequence[float], max_repeats: float) -> None:
    for s, target in zip(sources, targets, strict=True):
        if target > max_repeats * s.tokens:
            raise MixError(
                f"{s.label}: has {s.tokens:,} tokens, its share needs {round(target):,} "
                f"({target / s.tokens:.2f} passes), above --max-repeats {max_repeats:g}"
            )


# ---------------------------------------------------------------------------------------------- selection


def select_documents(lengths: np.ndarray, target: float, seed: int, source_id: int) -> np.ndarray:
    """Document numbers of a source in the order they are taken, whole, to come as close to `target` tokens as
    whole documents can (the written tokens differ from it by at most half the longest document).

    Pass e over the source follows a permutation drawn from `default_rng([seed, source_id, e])`: complete passes
    while they fit, then the prefix of the next pass whose token count is nearest the rest of the target.
    """
    total = int(lengths.sum())
    passes = int(target // total)
    rest = target - passes * total
    parts = [np.random.default_rng([seed, source_id, e]).permutation(lengths.size) for e in range(passes)]
    order = np.random.default_rng([seed, source_id, passes]).permutation(lengths.size)
    taken = np.cumsum(lengths[order])
    k = int(np.searchsorted(taken, rest, side="left"))  # the first k + 1 documents reach `rest`
    if k < lengths.size:
        below = int(taken[k - 1]) if k else 0
        k += 1 if taken[k] - rest < rest - below else 0
    parts.append(order[:k])
    return np.concatenate(parts)


def interleave(counts: Sequence[int], seed: int) -> np.ndarray:
    """The source id (uint8) of every document of the pool, in pool order: `counts[i]` of source i, shuffled by
    `default_rng([seed, ORDER_STREAM, 0])` so that every source is spread evenly through the pool."""
    labels = np.repeat(np.arange(len(counts), dtype=np.uint8), counts)
    np.random.default_rng([seed, ORDER_STREAM, 0]).shuffle(labels)
    return labels


def _pool_documents(labels: np.ndarray, selected: Sequence[np.ndarray]) -> np.ndarray:
    """The run-wide document number of every pool document: the k-th document of source i in the pool is the k-th
    of `selected[i]`."""
    # A stable sort groups the pool positions by source, each group in pool order: exactly the slots that
    # source's selection fills, in its order.
    slots = np.argsort(labels, kind="stable")
    docs = np.empty(labels.size, dtype=np.int64)
    docs[slots] = np.concatenate(selected) if selected else np.empty(0, dtype=np.int64)
    return docs


# ---------------------------------------------------------------------------------------------- the run


def _temporary_sibling(output: Path, tag: str) -> Path:
    path = output.with_name(f".{output.name}.{tag}-{os.getpid()}")
    if path.exists():
        shutil.rmtree(path)  # left by a crashed run that had this process id
    return path


def _move_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished pool to `output`; a previous folder there (checked to be empty or a pool) goes after."""
    if not output.exists():
        os.rename(tmp, output)
        return
    old = _temporary_sibling(output, "old")
    os.rename(output, old)
    try:
        os.rename(tmp, output)
    except OSError:
        os.rename(old, output)
        raise
    shutil.rmtree(old)


def mix_sources(
    sources: Sequence[SourceSpec],
    tokens: int,
    output: Path,
    *,
    seed: int = 0,
    max_repeats: float = 1.0,
    overwrite: bool = False,
    command: Sequence[str] = (),
    chunk_tokens: int = CHUNK_TOKENS,
) -> MixManifest:
    """Write a pool of about `tokens` tokens drawn from `sources` in the shares of their weights into `output`
    (see the module docstring); returns its manifest, which is also written as `output/mix.json`.

    Everything is checked before anything is written: names, weights and options; the output folder (refused when
    it is a file, a source's folder, or not empty without `overwrite`; even with it, a folder holding anything but
    pool files); every shard file; one tokenizer across all sources (metadata line and EOS id); and that no source
    needs more than `max_repeats` passes. `command` is recorded in the manifest. Raises `MixError` for bad input.
    """
    output = Path(output)
    _check_request(sources, tokens, seed, max_repeats)
    _check_output(output, overwrite, sources)
    opened = [_open_source(spec) for spec in sources]
    metadata_line, token_size = _check_one_tokenizer(opened)
    weight_sum = math.fsum(s.weight for s in sources)
    shares = [s.weight / weight_sum for s in sources]
    targets = [tokens * share for share in shares]
    _check_repeats(opened, targets, max_repeats)

    gatherer = Gatherer([f for s in opened for f in s.files])
    bases = np.cumsum([0] + [s.documents for s in opened]).tolist()
    selected = [
        select_documents(gatherer.doc_len[bases[i] : bases[i + 1]], target, seed, i) + bases[i]
        for i, target in enumerate(targets)
    ]
    counts = [int(sel.size) for sel in selected]
    if sum(counts) == 0:
        raise MixError(f"--tokens {tokens}: too few for one whole document of any source; ask for more")
    labels = interleave(counts, seed)
    docs = _pool_documents(labels, selected)

    written_sources = [
        MixSource(
            name=s.spec.name,
            path=s.spec.path,
            weight=float(s.spec.weight),
            target_share=share,
            target_tokens=round(target),
            tokens=int(gatherer.doc_len[sel].sum()),
            documents=int(sel.size),
            repeats=int(gatherer.doc_len[sel].sum()) / s.tokens,
            fingerprint=files_fingerprint(s.files),
        )
        for s, share, target, sel in zip(opened, shares, targets, selected, strict=True)
    ]

    final = output.resolve()  # a concrete name for the sibling folders, even for "." or "out/"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(final, "partial")
    tmp.mkdir()
    try:
        written = write_pool(tmp, gatherer, docs, labels, metadata_line, chunk_tokens)
        manifest = MixManifest(
            format=MANIFEST_FORMAT,
            seed=seed,
            tokens_requested=tokens,
            tokens=written,
            documents=int(docs.size),
            max_repeats=float(max_repeats),
            command=tuple(command),
            tokenizer=metadata_line,
            token_size=token_size,
            files=(POOL_FILE,),
            sources=tuple(written_sources),
        )
        write_manifest(tmp, manifest)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
