"""Compiled blocks do not recompile when the number or lengths of segments in a micro-batch change."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.batch import positions_from_seq_lens
from lmforge.model import build_model
from lmforge.model.init import init_weights
from tests.conftest import tiny_llama


@pytest.mark.slow
def test_new_segment_layouts_do_not_recompile() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model(tiny_llama(), 256, "sdpa", torch.device("cpu"))
    init_weights(model, 0.02, 0)
    for block in model.blocks:
        block.compile(fullgraph=True)  # as parallelize does for sdpa: a graph break would be an error
    gen = torch.Generator().manual_seed(0)
    graphs = []
    for segments in (1, 2, 3, 5, 8, 13):
        lens = torch.full((segments,), 96 // segments, dtype=torch.int32)
        lens[-1] += 96 - int(lens.sum())
        ids = torch.randint(0, 256, (1, 96), generator=gen)
        positions = torch.from_numpy(positions_from_seq_lens(lens.numpy()))[None]
        model(ids, positions, lens).float().square().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs
