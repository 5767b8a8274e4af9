"""`lmforge mix`: shares, seeded order, repeats, the tokenizer check, the manifest, `--verify` and the command."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lmforge.cli import COMMANDS
from lmforge.cli import main as cli_main
from lmforge.commands.mix import main, parse_token_count
from lmforge.data.mixture import (
    MANIFEST_NAME,
    MixError,
    MixManifest,
    MixSource,
    open_source_ids,
    read_manifest,
    source_fingerprint,
    write_manifest,
)
from lmforge.data.shards import ShardPool, list_shards, open_shard
from lmforge.prep.mix import SourceSpec, interleave, mix_sources, select_documents
from lmforge.prep.mix_verify import verify_mix
from lmforge.prep.pool_writer import _AppendFile, _chunks, concat_ranges
from tests.shards import random_docs, write_shard

POOL_FILES = ["mix.ds", "mix.ds.index", "mix.ds.metadata", "mix.ds.source", MANIFEST_NAME]


def make_source(folder: Path, seed: int, docs_per_file: tuple[int, ...], mean_len: int, **kw: object) -> Path:
    """A source folder of one shard file per entry of `docs_per_file`, documents of random lengths around
    `mean_len` (EOS 0 last), ids drawn from 1..299."""
    for k, n in enumerate(docs_per_file):
        write_shard(folder, f"part{k}", random_docs(n, seed * 100 + k, mean_len=mean_len), **kw)  # type: ignore[arg-type]
    return folder


def source_docs(folder: Path) -> list[tuple[int, ...]]:
    """Every document of a source folder, as a tuple of token ids, in file then index order."""
    docs = []
    for path in list_shards(folder):
        f = open_shard(path)
        ends = f.doc_ends.astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        docs += [tuple(f.tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    return docs


def pool_docs(folder: Path) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The pool's documents (token tuples, in pool order) and their source ids."""
    f = open_shard(folder / "mix.ds")
    ends = f.doc_ends.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    docs = [tuple(f.tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    return docs, np.array(open_source_ids(folder / "mix.ds"))


@pytest.fixture
def three(tmp_path: Path) -> list[SourceSpec]:
    """Three sources with very different document lengths (and several files each)."""
    return [
        SourceSpec("web", str(make_source(tmp_path / "web", 1, (150, 120), mean_len=12)), 6.0),
        SourceSpec("code", str(make_source(tmp_path / "code", 2, (40, 30, 20), mean_len=60)), 3.0),
        SourceSpec("math", str(make_source(tmp_path / "math", 3, (25,), mean_len=150)), 1.0),
    ]


def longest(folder: str) -> int:
    return max(len(d) for d in source_docs(Path(folder)))


# ---------------------------------------------------------------------------------------------- shares


@pytest.mark.parametrize("n_sources", [2, 3])
def test_shares_match_the_weights_within_one_document(three: list[SourceSpec], tmp_path: Path, n_sources: int) -> None:
    sources = three[:n_sources]
    tokens = 3000
    m = mix_sources(sources, tokens, tmp_path / "pool", seed=7, chunk_tokens=500)
    weight_sum = sum(s.weight for s in sources)
    counts = Counter()
    docs, ids = pool_docs(tmp_path / "pool")
    for doc, i in zip(docs, ids.tolist(), strict=True):
        counts[i] += len(doc)
    for i, (spec, written) in enumerate(zip(sources, m.sources, strict=True)):
        target = tokens * spec.weight / weight_sum
        assert abs(written.tokens - target) < longest(spec.path), (spec.name, written.tokens, target)
        assert counts[i] == written.tokens  # the manifest says what the pool holds
        assert written.target_share == pytest.approx(spec.weight / weight_sum)
        assert written.target_tokens == round(target)
    assert m.tokens == sum(counts.values()) == sum(len(d) for d in docs)
    assert m.documents == len(docs)
    assert sum(len(d) for d in docs) == pytest.approx(tokens, abs=sum(longest(s.path) for s in sources))


def test_select_documents_stops_nearest_the_target() -> None:
    lengths = np.array([5, 50, 7, 300, 11, 90, 23], dtype=np.int64)
    for target in (0.0, 1.0, 40.0, 250.0, 486.0, 600.0, 1000.5):
        chosen = select_documents(lengths, target, seed=3, source_id=1)
        written = int(lengths[chosen].sum())
        # the nearest of "just below" and "just above" along the pass order: within half a document
        passes = int(target // lengths.sum())
        order = np.random.default_rng([3, 1, passes]).permutation(lengths.size)
        options = passes * lengths.sum() + np.concatenate([[0], np.cumsum(lengths[order])])
        assert written == options[np.argmin(np.abs(options - target))]
    assert np.array_equal(select_documents(lengths, 486.0, 3, 1), np.random.default_rng([3, 1, 0]).permutation(7))


def test_interleave_spreads_every_source_through_the_pool() -> None:
    labels = interleave([6000, 3000, 1000], seed=0)
    assert labels.dtype == np.uint8 and np.bincount(labels).tolist() == [6000, 3000, 1000]
    for quarter in np.split(labels, 4):
        assert np.bincount(quarter, minlength=3) / quarter.size == pytest.approx([0.6, 0.3, 0.1], abs=0.04)


def test_ranges_concatenates_the_index_ranges() -> None:
    starts, lengths = np.array([10, 3, 40, 4]), np.array([2, 3, 1, 4])
    expected = [10, 11, 3, 4, 5, 40, 4, 5, 6, 7]
    assert concat_ranges(starts, lengths, np.empty(int(lengths.sum()), dtype=np.int64)).tolist() == expected


# ---------------------------------------------------------------------------------------------- content


def test_every_pool_document_is_a_document_of_its_source(three: list[SourceSpec], tmp_path: Path) -> None:
    m = mix_sources(three, 4000, tmp_path / "pool", seed=1, chunk_tokens=300)
    pool = ShardPool([tmp_path / "pool"])  # an ordinary shard folder: the .source file and mix.json are ignored
    assert [f.path.name for f in pool.files] == ["mix.ds"]
    assert pool.num_tokens == m.tokens and not pool.has_loss
    assert (tmp_path / "pool" / "mix.ds.metadata").read_text() == f"test-tokenizer|2\n{m.tokens}\n"
    docs, ids = pool_docs(tmp_path / "pool")
    assert sorted(p.name for p in (tmp_path / "pool").iterdir()) == sorted(POOL_FILES)
    known = [Counter(source_docs(Path(s.path))) for s in three]
    seen: list[Counter[tuple[int, ...]]] = [Counter() for _ in three]
    for doc, i in zip(docs, ids.tolist(), strict=True):
        assert doc in known[i], f"pool document {doc[:5]}... is not a document of {three[i].name}"
        assert doc[-1] == 0  # whole documents, EOS last
        seen[i][doc] += 1
    for i, counter in enumerate(seen):
        # max_repeats 1: no document of a source more often than it occurs there
        assert all(n <= known[i][doc] for doc, n in counter.items())
        assert sum(counter.values()) == m.sources[i].documents
    # the sources are interleaved, not written one after the other
    assert set(ids[: len(ids) // 3].tolist()) == {0, 1, 2}


def test_each_source_appears_in_the_order_of_its_seeded_passes(tmp_path: Path) -> None:
    web = SourceSpec("web", str(make_source(tmp_path / "web", 1, (200, 300), mean_len=8)), 1.0)
    code = SourceSpec("code", str(make_source(tmp_path / "code", 2, (15, 10), mean_len=40)), 1.0)
    m = mix_sources([web, code], 3000, tmp_path / "pool", seed=11, max_repeats=2, chunk_tokens=100)
    assert m.sources[1].repeats > 1  # code is read in two passes
    docs, ids = pool_docs(tmp_path / "pool")
    for i, spec in enumerate((web, code)):
        own = source_docs(Path(spec.path))
        lengths = np.array([len(d) for d in own], dtype=np.int64)
        # pass e of source i is the permutation of default_rng([seed, i, e]); the stop rule is tested above
        expected = [own[k] for k in select_documents(lengths, 1500.0, 11, i)]
        assert [d for d, j in zip(docs, ids.tolist(), strict=True) if j == i] == expected
        first_pass = np.random.default_rng([11, i, 0]).permutation(len(own))
        n = min(len(own), len(expected))
        assert expected[:n] == [own[k] for k in first_pass[:n]]


def test_both_ways_of_gathering_write_the_same_pool(
    three: list[SourceSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # half of the web source carries loss flags, so both ways also handle files with and without them
    web = Path(three[0].path)
    docs = random_docs(40, 77, mean_len=12)
    write_shard(web, "part9", docs, loss=[k % 2 for k in range(sum(len(d) for d in docs))])
    pools = {}
    for way, below in (("slices", 0), ("indexed", 10**9)):
        monkeypatch.setattr("lmforge.prep.pool_writer.INDEXED_BELOW", below)
        mix_sources(three, 3000, tmp_path / way, seed=2, chunk_tokens=400)
        pools[way] = {f: (tmp_path / way / f).read_bytes() for f in [*POOL_FILES, "mix.ds.loss"]}
    assert pools["slices"] == pools["indexed"]
    loss = np.frombuffer(pools["slices"]["mix.ds.loss"], dtype=np.uint8)
    assert 0 < loss.sum() < loss.size  # flags came from the loss file, ones from the files without


def test_loss_flags_follow_their_documents(tmp_path: Path) -> None:
    docs = random_docs(30, 5, mean_len=10)
    flags = [t % 2 for d in docs for t in d]  # a pattern that depends on the token, so it can be checked
    web = SourceSpec("web", str(tmp_path / "web"), 1.0)
    write_shard(tmp_path / "web", "a", docs, loss=flags)
    code = SourceSpec("code", str(make_source(tmp_path / "code", 2, (20,), mean_len=30)), 1.0)
    mix_sources([web, code], 400, tmp_path / "pool", chunk_tokens=50)
    pool = open_shard(tmp_path / "pool" / "mix.ds")
    assert pool.loss is not None
    ends = pool.doc_ends.astype(np.int64)
    ids = open_source_ids(tmp_path / "pool" / "mix.ds")
    for k, (a, b) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)):
        expected = pool.tokens[a:b] % 2 if ids[k] == 0 else np.ones(b - a)
        assert np.array_equal(pool.loss[a:b], expected)


# ---------------------------------------------------------------------------------------------- determinism


def test_the_same_seed_gives_the_same_bytes_and_another_seed_another_order(
    three: list[SourceSpec], tmp_path: Path
) -> None:
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        mix_sources(three, 3000, tmp_path / name, seed=seed, command=["cmd"], chunk_tokens=256)
    for file in POOL_FILES:
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    assert (tmp_path / "a" / "mix.ds").read_bytes() != (tmp_path / "c" / "mix.ds").read_bytes()
    assert not np.array_equal(pool_docs(tmp_path / "a")[1], pool_docs(tmp_path / "c")[1])
    # the chunk size is an implementation detail: it never changes the pool
    mix_sources(three, 3000, tmp_path / "d", seed=5, command=["cmd"])
    assert (tmp_path / "a" / "mix.ds").read_bytes() == (tmp_path / "d" / "mix.ds").read_bytes()


# ---------------------------------------------------------------------------------------------- repeats


def test_max_repeats_repeats_a_small_source(tmp_path: Path) -> None:
    big = SourceSpec("big", str(make_source(tmp_path / "big", 1, (300,), mean_len=20)), 1.0)
    small = SourceSpec("small", str(make_source(tmp_path / "small", 2, (10,), mean_len=20)), 1.0)
    small_tokens = sum(len(d) for d in source_docs(tmp_path / "small"))
    tokens = 5 * small_tokens  # the small source's half needs 2.5 passes
    m = mix_sources([big, small], tokens, tmp_path / "pool", max_repeats=3)
    assert m.sources[1].repeats == pytest.approx(m.sources[1].tokens / small_tokens)
    assert 2.2 < m.sources[1].repeats < 2.8
    docs, ids = pool_docs(tmp_path / "pool")
    counts = Counter(d for d, i in zip(docs, ids.tolist(), strict=True) if i == 1)
    # two whole passes, then part of a third: every document twice or three times
    assert set(counts.values()) <= {2, 3} and len(counts) == 10 and 3 in counts.values()
    assert m.sources[0].repeats <= 1.0

    with pytest.raises(MixError) as e:
        mix_sources([big, small], tokens, tmp_path / "other", max_repeats=2)
    message = str(e.value)
    assert f"source small (folder {small.path}): has {small_tokens:,} tokens" in message
    assert f"needs {round(tokens / 2):,} ({tokens / 2 / small_tokens:.2f} passes), above --max-repeats 2" in message
    assert not (tmp_path / "other").exists()


# ---------------------------------------------------------------------------------------------- tokenizer


def test_sources_of_different_tokenizers_are_refused(three: list[SourceSpec], tmp_path: Path) -> None:
    meta = Path(three[1].path) / "part1.ds.metadata"
    lines = meta.read_text().splitlines()
    meta.write_text(f"other-tokenizer|2\n{lines[1]}\n")
    with pytest.raises(MixError) as e:
        mix_sources(three, 1000, tmp_path / "pool")
    assert "source code" in str(e.value) and "source web" in str(e.value)
    assert "tokenizer 'other-tokenizer' vs 'test-tokenizer'" in str(e.value)
    assert not (tmp_path / "pool").exists()


def test_sources_with_different_eos_ids_are_refused(three: list[SourceSpec], tmp_path: Path) -> None:
    docs = [[*d[:-1], 7] for d in random_docs(20, 9, mean_len=10)]
    other = SourceSpec("other", str(tmp_path / "other"), 1.0)
    write_shard(tmp_path / "other", "a", docs)
    with pytest.raises(MixError, match=r"source other \(folder .*\) and source web .*EOS ids: 7 in a.ds, 0 in"):
        mix_sources([three[0], other], 1000, tmp_path / "pool")


def test_token_sizes_must_match(three: list[SourceSpec], tmp_path: Path) -> None:
    wide = SourceSpec("wide", str(make_source(tmp_path / "wide", 4, (20,), mean_len=10, token_size=4)), 1.0)
    with pytest.raises(MixError, match="token size 4 vs 2 bytes"):
        mix_sources([three[0], wide], 500, tmp_path / "pool")


# ---------------------------------------------------------------------------------------------- manifest


def test_the_manifest_round_trips(three: list[SourceSpec], tmp_path: Path) -> None:
    m = mix_sources(three, 2000, tmp_path / "pool", seed=3, command=["lmforge", "mix", "x.toml"])
    assert read_manifest(tmp_path / "pool") == m
    assert m.files == ("mix.ds",) and m.token_size == 2 and m.tokenizer == "test-tokenizer|2"
    assert m.sources[0].fingerprint == source_fingerprint(Path(three[0].path))
    assert m.sources[0].fingerprint["files"][1]["name"] == "part1.ds"
    assert m.source_names == ("web", "code", "math")
    data = json.loads((tmp_path / "pool" / MANIFEST_NAME).read_text())
    assert data["command"] == ["lmforge", "mix", "x.toml"] and data["sources"][2]["name"] == "math"

    source = MixSource("a", "x", 2.0, 1.0, 10, 11, 2, 0.5, {"files": [], "tokens": 22, "documents": 4})
    other = MixManifest(1, 0, 10, 11, 2, 1.5, ("a", "b"), "t|4", 4, ("mix.ds",), (source,))
    write_manifest(tmp_path, other)
    assert read_manifest(tmp_path) == other


def test_a_bad_manifest_is_named(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(MixError, match=f"{MANIFEST_NAME}: not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 1, "seed": 0}))
    with pytest.raises(MixError, match=f"{MANIFEST_NAME}: missing keys .*'sources'"):
        read_manifest(tmp_path)


def test_source_ids_must_match_the_index(three: list[SourceSpec], tmp_path: Path) -> None:
    mix_sources(three, 1000, tmp_path / "pool")
    ids = tmp_path / "pool" / "mix.ds.source"
    ids.write_bytes(ids.read_bytes()[:-1])
    with pytest.raises(MixError, match=r"mix.ds.source: \d+ bytes, expected one per document of mix.ds.index"):
        open_source_ids(tmp_path / "pool" / "mix.ds")


# ---------------------------------------------------------------------------------------------- output folder


def test_an_existing_folder_is_replaced_only_when_asked(three: list[SourceSpec], tmp_path: Path) -> None:
    out = tmp_path / "pool"
    mix_sources(three, 1000, out, seed=1)
    with pytest.raises(MixError, match="not empty"):
        mix_sources(three, 1000, out, seed=2)
    assert read_manifest(out).seed == 1  # type: ignore[union-attr]
    mix_sources(three, 1000, out, seed=2, overwrite=True)
    assert read_manifest(out).seed == 2  # type: ignore[union-attr]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(MixError, match="not part of a mix pool"):
        mix_sources(three, 1000, out, seed=3, overwrite=True)
    assert (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code", "math", "pool", "web"]  # no temporary folders


# ---------------------------------------------------------------------------------------------- verify


def test_verify_passes_on_a_good_pool_and_fails_on_a_tampered_one(
    three: list[SourceSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pool"
    m = mix_sources(three, 2000, out, seed=4)
    check = verify_mix(out)
    assert check.tokens == tuple(s.tokens for s in m.sources) and check.warnings == ()
    assert main(["--verify", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "consistent" in printed and "web" in printed and f"{m.sources[1].tokens:,}" in printed

    # a source that changed since is a warning, not an error
    write_shard(Path(three[2].path), "part9", random_docs(3, 0))
    assert main(["--verify", str(out)]) == 0
    assert "warning: source math" in capsys.readouterr().err

    ids = out / "mix.ds.source"
    tampered = bytearray(ids.read_bytes())
    tampered[0] = (tampered[0] + 1) % 3
    ids.write_bytes(bytes(tampered))
    with pytest.raises(MixError, match=r"mix\.ds\.source: source"):
        verify_mix(out)
    assert main(["--verify", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lmforge mix: error:" in err and "mix.ds.source" in err and len(err.strip().splitlines()) == 1

    tampered[0] = 9
    ids.write_bytes(bytes(tampered))
    with pytest.raises(MixError, match="document 0 has source id 9"):
        verify_mix(out)


# ---------------------------------------------------------------------------------------------- the command


def test_the_command_writes_a_pool_from_flags_and_from_toml(
    three: list[SourceSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f"--source={s.name}={s.path}:{s.weight:g}" for s in three]
    assert main([*flags, "--tokens", "3_000", "--output", str(tmp_path / "a"), "--seed", "2"]) == 0
    table = capsys.readouterr().out
    assert "target share" in table and "60.00%" in table and "math" in table

    toml = tmp_path / "mix.toml"
    tables = "".join(f'[[source]]\nname = "{s.name}"\npath = "{s.path}"\nweight = {s.weight}\n' for s in three)
    toml.write_text(f'tokens = "3k"\noutput = "{tmp_path / "b"}"\nseed = 9\n{tables}')
    assert main([str(toml), "--seed", "2"]) == 0  # the flag overrides the file's seed
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert a is not None and b is not None
    assert b.seed == 2 and b.command == ("lmforge", "mix", str(toml), "--seed", "2")
    assert (tmp_path / "a" / "mix.ds").read_bytes() == (tmp_path / "b" / "mix.ds").read_bytes()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--source", "bad", "--tokens", "10", "--output", "x"], "--source 'bad': expected NAME=FOLDER:WEIGHT"),
        (["--source", "a=b:heavy", "--tokens", "10", "--output", "x"], "weight 'heavy' is not a number"),
        (["--source", "a b=b:1", "--tokens", "10", "--output", "x"], "source name 'a b'"),
        (["--source", "a=b:0", "--tokens", "10", "--output", "x"], "weight 0.0 must be a finite number above 0"),
        (["--source", "a=b:1", "--tokens", "ten", "--output", "x"], "--tokens 'ten'"),
        (["--source", "a=b:1", "--output", "x"], "--tokens is required"),
        (["--source", "a=b:1", "--tokens", "10", "--output", "x", "--max-repeats", "0.5"], "--max-repeats 0.5"),
        (["--source", "a=nowhere:1", "--tokens", "10", "--output", "x"], "source a: data path nowhere is not a folder"),
        (["--tokens", "10", "--bogus"], "unrecognized arguments: --bogus"),
        (["--verify", "x", "--seed", "1"], "--verify DIR takes no other arguments"),
        (["--verify", "nowhere"], "nowhere: not a folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmforge mix: error:") and message in lines[0], captured.err
    assert "Traceback" not in captured.err and not (tmp_path / "x").exists()


def test_bad_toml_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "mix.toml"
    toml.write_text('tokens = 10\noutput = "x"\nsead = 1\n')
    assert main([str(toml)]) == 2
    assert f"{toml}: unknown keys ['sead']" in capsys.readouterr().err
    toml.write_text('tokens = 10\noutput = "x"\n[[source]]\nname = "a"\npath = "p"\n')
    assert main([str(toml)]) == 2
    assert "source[0]: expected the keys name, path and weight" in capsys.readouterr().err


def test_token_counts_take_underscores_and_suffixes() -> None:
    assert parse_token_count("1_000_000") == 1_000_000
    assert parse_token_count("10M") == 10_000_000
    assert parse_token_count("2.5B") == 2_500_000_000
    assert parse_token_count("3k") == 3000
    with pytest.raises(MixError, match="not a whole number"):
        parse_token_count("1.5")


def test_chunks_cover_the_pool_within_both_caps() -> None:
    lengths = np.random.default_rng(0).integers(1, 50, size=1000)
    lengths[500] = 400  # longer than a chunk: a chunk of its own
    ends = np.cumsum(lengths)
    chunks = _chunks(ends, chunk_tokens=100, chunk_docs=7)
    assert chunks[0][0] == 0 and chunks[-1][1] == 1000
    assert all(b0 == a1 for (_, b0), (a1, _) in itertools.pairwise(chunks))
    for a, b in chunks:
        assert 0 < b - a <= 7
        assert lengths[a:b].sum() < 100 + lengths[a]
    assert 500 in [a for a, _ in chunks]  # the long document starts a chunk


@pytest.mark.parametrize("direct", [True, False])
def test_append_file_writes_every_byte_in_order(tmp_path: Path, direct: bool) -> None:
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 255, size=n, dtype=np.uint8) for n in (7, 5000, 3 * 8192 + 1, 0, 8192, 13)]
    pieces.append(rng.integers(0, 60000, size=999, dtype=np.uint16))  # arrays of any dtype, and bytes
    f = _AppendFile(tmp_path / "out.bin", block=8192, direct=direct)
    for p in pieces:
        f.write(p)
    f.write(b"tail")
    f.close()
    assert direct or not f.direct
    assert (tmp_path / "out.bin").read_bytes() == b"".join(p.tobytes() for p in pieces) + b"tail"


def test_the_cli_runs_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert COMMANDS["mix"][0] == "mix"
    assert cli_main(["mix", "--source", "bad", "--tokens", "1", "--output", "x"]) == 2
    assert "lmforge mix: error: --source 'bad'" in capsys.readouterr().err
