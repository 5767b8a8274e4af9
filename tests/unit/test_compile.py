"""Compiled blocks do not recompile when the number or lengths of segments in a micro-batch change."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.batch import positions_from_seq_lens
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.parallel.fsdp import FULLGRAPH_BACKENDS
from tests.conftest import tiny_llama


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_loop", "auto"])
def test_new_segment_layouts_do_not_recompile(backend: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model(tiny_llama(), 256, backend, torch.device("cpu"), compiled=True)
    init_weights(model, 0.02, 0)
    eager = build_model(tiny_llama(), 256, backend, torch.device("cpu"))
    eager.load_state_dict(model.state_dict())
    for block in model.blocks:
        # As parallelize does: sdpa as one graph (a graph break would be an error); the per-segment backends run
        # eagerly between two graphs.
        block.compile(fullgraph=backend in FULLGRAPH_BACKENDS)
    gen = torch.Generator().manual_seed(0)
    graphs = []
    # 1-13 segments run per segment under auto; 48 segments of 2 tokens the masked kernel.
    for segments in (1, 2, 3, 5, 8, 13, 48):
        lens = torch.full((segments,), 96 // segments, dtype=torch.int32)
        lens[-1] += 96 - int(lens.sum())
        ids = torch.randint(0, 256, (1, 96), generator=gen)
        positions = torch.from_numpy(positions_from_seq_lens(lens.numpy()))[None]
        out = model(ids, positions, lens)
        out.float().square().mean().backward()
        torch.testing.assert_close(out, eager(ids, positions, lens), atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs
