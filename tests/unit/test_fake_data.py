"""Fake data through the micro-batch contract, and world-size independent window dealing."""

from __future__ import annotations

import torch

from lmforge.config import FakeDataConfig
from lmforge.data.batch import StepLayout, Window, pack_windows, segments_from_doc_starts
from lmforge.data.fake import fake_window
from lmforge.data.stream import build_step_data


def cfg(**fields: object) -> FakeDataConfig:
    base: dict[str, object] = {"seq_len": 64, "batch_tokens": 512, "micro_batch_tokens": 128, "mean_doc_len": 20}
    return FakeDataConfig(**{**base, **fields})


def test_micro_batch_contract() -> None:
    mbs = build_step_data(cfg(), 0, 1).next_step()
    assert len(mbs) == 4
    for mb in mbs:
        assert mb.source_tokens is None  # fake data has no mixture sources
        for key in ("input_ids", "target_ids", "position_ids"):
            assert getattr(mb, key).dtype == torch.int64 and getattr(mb, key).shape == (1, 128)
        assert mb.loss_mask.dtype == torch.bool and bool(mb.loss_mask.all())
        assert mb.doc_lens.dtype == torch.int32 and int(mb.doc_lens.sum()) == 128
        # positions restart at 0 at every segment
        starts = torch.cumsum(mb.doc_lens, 0) - mb.doc_lens
        assert torch.all(mb.position_ids[0, starts.long()] == 0)
        assert int(mb.position_ids.max()) == int(mb.doc_lens.max()) - 1
        # targets are the inputs shifted by one inside each window
        assert torch.equal(mb.input_ids[0, 1:64], mb.target_ids[0, :63])


def test_windows_split_into_documents_only_with_masking() -> None:
    masked = fake_window(cfg(), 3)
    plain = fake_window(cfg(document_masking=False), 3)
    assert len(masked.seg_lens) > 1 and list(plain.seg_lens) == [64]
    assert (masked.tokens == plain.tokens).all()


def test_counting_pattern_has_one_stride_per_document() -> None:
    c = cfg(pattern="counting", vocab_size=1000)
    for index in range(5):
        w = fake_window(c, index)
        offset = 0
        for length in w.seg_lens:
            doc = w.tokens[offset : offset + length]
            offset += length
            steps = set(((doc[1:] - doc[:-1]) % c.vocab_size).tolist())
            assert len(steps) <= 1 and steps <= set(range(1, 9)), steps


def test_segments_from_doc_starts() -> None:
    assert segments_from_doc_starts([3, 10, 64, 80], 64) == [3, 7, 54]
    assert segments_from_doc_starts([], 8) == [8]


def test_pack_windows_rejects_bad_segments() -> None:
    import numpy as np
    import pytest

    with pytest.raises(ValueError, match="add up to"):
        pack_windows([Window(np.arange(9), [3, 3])])


def test_global_stream_does_not_depend_on_world_size() -> None:
    c = cfg(batch_tokens=1024)
    one = build_step_data(c, 0, 1)
    two = [build_step_data(c, r, 2) for r in range(2)]
    for _ in range(3):
        whole = torch.cat([mb.input_ids for mb in one.next_step()], dim=1)
        dealt = torch.cat([mb.input_ids for r in range(2) for mb in two[r].next_step()], dim=1)
        assert torch.equal(whole, dealt)


def test_resume_continues_the_stream() -> None:
    a = build_step_data(cfg(), 0, 1)
    a.next_step()
    state = a.state_dict()
    expected = a.next_step()
    b = build_step_data(cfg(), 0, 1)
    b.load_state_dict(state)
    got = b.next_step()
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(expected, got, strict=True))


def test_layout_gradient_accumulation() -> None:
    layout = StepLayout.from_tokens(seq_len=64, batch_tokens=1024, micro_batch_tokens=128, rank=1, world_size=2)
    assert layout.micro_batches_per_step == 4
    assert layout.rank_windows(16) == range(24, 32)
