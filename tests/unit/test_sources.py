"""Per-source token counts of a mixture pool: the counting itself, the micro-batches' counts and the callback."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmforge.config import TokensDataConfig
from lmforge.data.mixture import MixError
from lmforge.data.shards import ShardPool, list_shards, open_shard
from lmforge.data.sources import SourceMap
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.data.tokens import TokenData
from lmforge.prep.mix import SourceSpec, mix_sources
from lmforge.train.callbacks.source_shares import SourceShares
from tests.shards import random_docs, word_tokenizer, write_shard

SEQ = 16


@pytest.fixture
def tok(tmp_path: Path) -> TokenizerInfo:
    return load_tokenizer(word_tokenizer(tmp_path / "tok"))


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """A pool of two sources of different document lengths, 2:1."""
    write_shard(tmp_path / "short", "a", random_docs(300, seed=1, mean_len=6))
    write_shard(tmp_path / "long", "a", random_docs(40, seed=2, mean_len=40))
    write_shard(tmp_path / "long", "b", random_docs(30, seed=3, mean_len=40))
    specs = [SourceSpec("short", str(tmp_path / "short"), 2.0), SourceSpec("long", str(tmp_path / "long"), 1.0)]
    mix_sources(specs, 2400, tmp_path / "mix", seed=7)
    return tmp_path / "mix"


def token_sources(folders: list[Path]) -> tuple[np.ndarray, list[str]]:
    """The source name index of every token of the pool, built by expanding each document (independently of
    `SourceMap`): mixture folders from their `.source` files, other folders as one source each."""
    names: list[str] = []
    per_token = []
    for folder in folders:
        manifest = folder / "mix.json"
        for path in list_shards(folder):
            f = open_shard(path)
            lengths = np.diff(np.concatenate([[0], f.doc_ends.astype(np.int64)]))
            if manifest.is_file():
                source_names = [s["name"] for s in json.loads(manifest.read_text())["sources"]]
                ids = np.fromfile(path.with_name(path.name + ".source"), dtype=np.uint8)
                labels = [source_names[i] for i in ids]
            else:
                labels = [folder.name] * len(lengths)
            for label, n in zip(labels, lengths.tolist(), strict=True):
                if label not in names:
                    names.append(label)
                per_token.append(np.full(n, names.index(label)))
    return np.concatenate(per_token), names


def test_counts_equal_the_sources_of_every_token(mixed: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    write_shard(plain, "x", random_docs(20, seed=9))
    folders = [mixed, plain]
    pool = ShardPool(folders)
    smap = SourceMap(pool, folders)
    per_token, names = token_sources(folders)
    assert smap.names == tuple(names) == ("short", "long", "plain")
    rng = np.random.default_rng(0)
    starts, lengths = rng.integers(0, pool.num_tokens - 200, 40), rng.integers(1, 200, 40)
    spans = [(0, pool.num_tokens), (pool.num_tokens - 50, 50), *zip(starts.tolist(), lengths.tolist(), strict=True)]
    # One span crosses from the mixture's file into the plain folder's.
    spans.append((pool.num_tokens - int((per_token == 2).sum()) - 50, 100))
    for start, length in spans:
        expected = np.bincount(per_token[start : start + length], minlength=3)
        np.testing.assert_array_equal(smap.count(start, length), expected, err_msg=f"span {start}+{length}")


def test_a_pool_without_mixtures_has_no_source_map(tmp_path: Path) -> None:
    write_shard(tmp_path / "p", "x", random_docs(20, seed=9))
    assert SourceMap.for_pool(ShardPool([tmp_path / "p"]), [tmp_path / "p"]) is None


def test_a_file_the_manifest_does_not_list_is_refused(mixed: Path) -> None:
    write_shard(mixed, "extra", random_docs(5, seed=4))
    with pytest.raises(MixError, match=r"extra\.ds: not among the files of"):
        SourceMap(ShardPool([mixed]), [mixed])


def test_micro_batches_carry_the_counts_of_their_windows(mixed: Path, tok: TokenizerInfo) -> None:
    """Over several steps and epochs, each micro-batch's `source_tokens` equals the count read from its windows'
    own positions in the pool."""
    cfg = TokensDataConfig(seq_len=SEQ, batch_tokens=4 * SEQ, micro_batch_tokens=2 * SEQ, paths=[str(mixed)],
                           max_epochs=5)  # fmt: skip
    data = TokenData(cfg, 0, 1, tok)
    per_token, _ = token_sources([mixed])
    windows = 0
    for _ in range(60):  # more than one epoch of this pool
        for mb in data.next_step():
            expected = np.zeros(2, dtype=np.int64)
            for w in range(windows, windows + 2):
                epoch, index = data.position(w)
                offset, order = data._order(epoch)
                start = offset + int(order[index]) * SEQ
                expected += np.bincount(per_token[start + 1 : start + 1 + SEQ], minlength=2)
            windows += 2
            np.testing.assert_array_equal(mb.source_tokens.numpy(), expected)
            assert int(mb.source_tokens.sum()) == mb.target_ids.numel()
    assert data.position(windows)[0] >= 1


def test_the_callback_keeps_running_totals_and_resumes_them() -> None:
    trainer = SimpleNamespace(ctx=SimpleNamespace(device=torch.device("cpu"), counts_rows=True))
    shares = SourceShares(["web", "code"])
    batches = [SimpleNamespace(source_tokens=torch.tensor([3, 1])), SimpleNamespace(source_tokens=torch.tensor([2, 2]))]
    shares.on_step_start(trainer, batches)  # type: ignore[arg-type]
    sent = shares.step_sums(trainer)  # type: ignore[arg-type]
    assert sent["source_tokens"].tolist() == [5.0, 3.0]
    # A rank whose rows another rank counts (another rank of its TP or pipeline group) sends zeros.
    other = SimpleNamespace(ctx=SimpleNamespace(device=torch.device("cpu"), counts_rows=False))
    twin = SourceShares(["web", "code"])
    twin.on_step_start(other, batches)  # type: ignore[arg-type]
    assert twin.step_sums(other)["source_tokens"].tolist() == [0.0, 0.0]  # type: ignore[arg-type]
    # The reduction sums over ranks: as if a second rank had the same counts.
    metrics = shares.on_step_reduced(trainer, {"source_tokens": np.array([10.0, 6.0])})  # type: ignore[arg-type]
    assert metrics == {"data/source/web/tokens": 10.0, "data/source/web/share": 10 / 16,
                       "data/source/code/tokens": 6.0, "data/source/code/share": 6 / 16}  # fmt: skip
    resumed = SourceShares(["web", "code", "math"])
    resumed.load_state_dict(shares.state_dict())
    metrics = resumed.on_step_reduced(trainer, {"source_tokens": np.array([1.0, 1.0, 2.0])})  # type: ignore[arg-type]
    assert metrics["data/source/web/tokens"] == 11.0 and metrics["data/source/math/tokens"] == 2.0
