"""Token-shard data: exact reads, window order per epoch, resume, world-size independence, masks, bad shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import TokensDataConfig
from lmforge.data.batch import MicroBatch
from lmforge.data.shards import ShardError, ShardPool
from lmforge.data.stream import build_step_data
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.data.tokens import TokenData
from tests.shards import random_docs, word_tokenizer, write_shard

SEQ = 16


@pytest.fixture
def tok(tmp_path: Path) -> TokenizerInfo:
    return load_tokenizer(word_tokenizer(tmp_path / "tok"))


def cfg(paths: list[Path], **fields: object) -> TokensDataConfig:
    base: dict[str, object] = {"seq_len": SEQ, "batch_tokens": 4 * SEQ, "micro_batch_tokens": 2 * SEQ,
                               "paths": [str(p) for p in paths], "max_epochs": 50}  # fmt: skip
    return TokensDataConfig(**{**base, **fields})


@pytest.fixture
def pool_dirs(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    write_shard(a, "00000", random_docs(30, seed=1))
    write_shard(a, "00001", random_docs(25, seed=2))
    write_shard(b, "00000", random_docs(40, seed=3), token_size=4)
    return [a, b]


def pool_stream(dirs: list[Path]) -> np.ndarray:
    return np.concatenate([np.fromfile(p, dtype=np.uint16 if p.parent.name != "b" else np.uint32)
                           for d in dirs for p in sorted(d.glob("*.ds"))]).astype(np.int64)  # fmt: skip


def test_pool_reads_folders_then_files_in_order(pool_dirs: list[Path]) -> None:
    pool = ShardPool(pool_dirs)
    stream = pool_stream(pool_dirs)
    assert pool.num_tokens == len(stream)
    for start in (0, 5, pool.starts[1] - 3, pool.starts[2] - 1, pool.num_tokens - 17):
        tokens, doc_starts, loss = pool.read(int(start), 17)
        assert np.array_equal(tokens, stream[start : start + 17])
        assert loss is None
        # a document starts right after every EOS (id 0) inside the span
        eos_positions = np.flatnonzero(stream[start : start + 16] == 0) + start + 1
        assert np.array_equal(doc_starts, eos_positions[eos_positions < start + 17])


def test_every_window_once_per_epoch_and_epochs_differ(pool_dirs: list[Path], tok: TokenizerInfo) -> None:
    data = TokenData(cfg(pool_dirs), 0, 1, tok)
    stream = pool_stream(pool_dirs)
    for epoch in range(2):
        offset, order = data._order(epoch)
        assert sorted(order.tolist()) == list(range(data.epoch_size(epoch)))
        assert data.epoch_size(epoch) == (len(stream) - offset - 1) // SEQ
    first = [data.window(i).tokens[0] for i in range(data.epoch_size(0))]
    second = [data.window(data.epoch_size(0) + i).tokens[0] for i in range(data.epoch_size(1))]
    assert first != second
    # within an epoch, each window is the stride-SEQ slice of the pool it claims to be, and targets cover every
    # token after the epoch's offset once
    offset, order = data._order(0)
    covered = np.zeros(len(stream), dtype=int)
    for i in range(data.epoch_size(0)):
        w = data.window(i)
        start = offset + int(order[i]) * SEQ
        assert np.array_equal(w.tokens, stream[start : start + SEQ + 1])
        covered[start + 1 : start + SEQ + 1] += 1
    assert covered.max() == 1 and covered.sum() == data.epoch_size(0) * SEQ


def test_resume_mid_epoch_continues_the_stream(pool_dirs: list[Path], tok: TokenizerInfo) -> None:
    straight = TokenData(cfg(pool_dirs), 0, 1, tok)
    for _ in range(7):
        straight.next_step()
    state = straight.state_dict()
    expected = [straight.next_step() for _ in range(40)]  # runs past the end of epoch 0
    resumed = TokenData(cfg(pool_dirs), 0, 1, tok)
    resumed.load_state_dict(state)
    got = [resumed.next_step() for _ in range(40)]
    for a, b in zip(expected, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert all(torch.equal(getattr(x, k), getattr(y, k)) for k in (*MicroBatch.PER_TOKEN, "doc_lens"))
    assert resumed.state_dict() == straight.state_dict() and resumed.state_dict()["epoch"] >= 1


def test_resume_on_a_changed_pool_is_refused(pool_dirs: list[Path], tok: TokenizerInfo) -> None:
    data = TokenData(cfg(pool_dirs), 0, 1, tok)
    for _ in range(30):
        data.next_step()
    state = data.state_dict()
    other = TokenData(cfg(pool_dirs[:1]), 0, 1, tok)
    with pytest.raises(ShardError, match="changed since"):
        other.load_state_dict(state)


def test_world_sizes_consume_the_same_global_windows(pool_dirs: list[Path], tok: TokenizerInfo) -> None:
    c = cfg(pool_dirs, batch_tokens=8 * SEQ)
    one = build_step_data(c, 0, 1, tok)
    two = [build_step_data(c, r, 2, tok) for r in range(2)]
    for _ in range(12):
        whole = torch.cat([mb.input_ids for mb in one.next_step()], dim=1)
        dealt = torch.cat([mb.input_ids for r in range(2) for mb in two[r].next_step()], dim=1)
        assert torch.equal(whole, dealt)


def test_document_masking_segments_match_documents(pool_dirs: list[Path], tok: TokenizerInfo) -> None:
    data = TokenData(cfg(pool_dirs), 0, 1, tok)
    plain = TokenData(cfg(pool_dirs, document_masking=False), 0, 1, tok)
    for i in range(20):
        w = data.window(i)
        # segments restart right after each EOS among the inputs, and only there
        cuts = np.cumsum(w.seg_lens)[:-1]
        assert np.array_equal(cuts, np.flatnonzero(w.tokens[: SEQ - 1] == 0) + 1)
        assert list(plain.window(i).seg_lens) == [SEQ]


def test_loss_file_becomes_the_loss_mask(tmp_path: Path, tok: TokenizerInfo) -> None:
    docs = random_docs(20, seed=5)
    total = sum(len(d) for d in docs)
    flags = (np.arange(total) % 3 != 0).astype(np.uint8)
    write_shard(tmp_path / "l", "00000", docs, loss=flags.tolist())
    data = TokenData(cfg([tmp_path / "l"]), 0, 1, tok)
    offset, order = data._order(0)
    w = data.window(0)
    start = offset + int(order[0]) * SEQ
    assert np.array_equal(w.loss_mask, flags[start + 1 : start + SEQ + 1].astype(bool))


def test_too_little_data_names_the_epochs_needed(pool_dirs: list[Path], tok: TokenizerInfo) -> None:
    data = TokenData(cfg(pool_dirs, max_epochs=1), 0, 1, tok)
    steps = 3 * data.pool.num_tokens // (4 * SEQ)
    with pytest.raises(ShardError, match="needs 3 epochs"):
        data.check_budget(steps)
    data.check_budget(data.pool.num_tokens // (4 * SEQ))


def test_bad_shards_fail_with_the_file_named(tmp_path: Path, tok: TokenizerInfo) -> None:
    docs = random_docs(10, seed=7)
    # made without eos_token: documents do not end with EOS
    write_shard(tmp_path / "noeos", "00000", [[*d[:-1], 5] for d in docs])
    with pytest.raises(ShardError, match=r"noeos/00000\.ds: the first document ends with token id 5, expected .* 0"):
        TokenData(cfg([tmp_path / "noeos"]), 0, 1, tok)
    # truncated .ds
    path = write_shard(tmp_path / "trunc", "00000", docs)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1)
    with pytest.raises(ShardError, match="not a multiple of the token size"):
        ShardPool([tmp_path / "trunc"])
    # missing and inconsistent index
    path = write_shard(tmp_path / "noindex", "00000", docs)
    path.with_name("00000.ds.index").unlink()
    with pytest.raises(ShardError, match=r"00000\.ds\.index is missing"):
        ShardPool([tmp_path / "noindex"])
    path = write_shard(tmp_path / "badindex", "00000", docs)
    np.array([3, 2, sum(len(d) for d in docs)], dtype=np.uint64).tofile(path.with_name("00000.ds.index"))
    with pytest.raises(ShardError, match="not strictly increasing"):
        ShardPool([tmp_path / "badindex"])
    path = write_shard(tmp_path / "shortindex", "00000", docs)
    np.array([3, 9], dtype=np.uint64).tofile(path.with_name("00000.ds.index"))
    with pytest.raises(ShardError, match="last document ends at 9"):
        ShardPool([tmp_path / "shortindex"])
    # empty folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match=r"holds no \.ds token shards"):
        ShardPool([tmp_path / "empty"])


def test_damaged_files_and_metadata_fail_with_the_file_named(tmp_path: Path) -> None:
    docs = random_docs(10, seed=3)
    total = sum(len(d) for d in docs)

    def shard(name: str) -> Path:
        return write_shard(tmp_path / name, "00000", docs)

    # Cut by whole tokens: the file disagrees with its metadata.
    path = shard("cut")
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 20)
    with pytest.raises(ShardError, match=rf"cut/00000\.ds: holds {total - 10} tokens but its metadata says {total}"):
        ShardPool([tmp_path / "cut"])
    # Cut with the metadata rewritten to match: the index now points past the end.
    path = shard("pastend")
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 20)
    path.with_name("00000.ds.metadata").write_text(f"test-tokenizer|2\n{total - 10}\n")
    with pytest.raises(ShardError, match=rf"00000\.ds\.index: last document ends at {total} but 00000\.ds holds"):
        ShardPool([tmp_path / "pastend"])
    # Missing metadata, metadata of another token size, and metadata that is not the format.
    shard("nometa").with_name("00000.ds.metadata").unlink()
    with pytest.raises(ShardError, match=r"nometa/00000\.ds: metadata file 00000\.ds\.metadata is missing"):
        ShardPool([tmp_path / "nometa"])
    shard("size4").with_name("00000.ds.metadata").write_text(f"test-tokenizer|4\n{total}\n")
    with pytest.raises(ShardError, match=rf"size4/00000\.ds: holds {total // 2} tokens but its metadata says {total}"):
        ShardPool([tmp_path / "size4"])
    shard("size3").with_name("00000.ds.metadata").write_text(f"test-tokenizer|3\n{total}\n")
    with pytest.raises(ShardError, match=r"size3/00000\.ds\.metadata: token_size 3 is not 2"):
        ShardPool([tmp_path / "size3"])
    shard("garbled").with_name("00000.ds.metadata").write_text("just one line\n")
    with pytest.raises(ShardError, match=r"garbled/00000\.ds\.metadata: expected 'tokenizer\|token_size'"):
        ShardPool([tmp_path / "garbled"])
    # A zero-length document: its end offset repeats the one before.
    path = shard("emptydoc")
    ends = np.cumsum([len(d) for d in docs])
    np.array([ends[0], ends[0], *ends[1:]], dtype=np.uint64).tofile(path.with_name("00000.ds.index"))
    with pytest.raises(ShardError, match=rf"00000\.ds\.index: document 1 is empty \(its end offset {ends[0]} repeats"):
        ShardPool([tmp_path / "emptydoc"])
    # A file with no tokens at all.
    empty = tmp_path / "notokens" / "00000.ds"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    empty.with_name("00000.ds.metadata").write_text("test-tokenizer|2\n0\n")
    with pytest.raises(ShardError, match=r"notokens/00000\.ds: holds no tokens"):
        ShardPool([tmp_path / "notokens"])


def test_token_outside_the_vocabulary_names_file_and_offset(tmp_path: Path, tok: TokenizerInfo) -> None:
    docs = random_docs(40, seed=9)
    docs[3][1] = 999  # the tokenizer has 300 ids
    write_shard(tmp_path / "oov", "00000", docs)
    data = TokenData(cfg([tmp_path / "oov"]), 0, 1, tok)
    offset = sum(len(d) for d in docs[:3]) + 1
    with pytest.raises(ShardError, match=rf"oov/00000\.ds: token id 999 at offset {offset} is outside"):
        for i in range(data.epoch_size(0)):
            data.window(i)
