"""Compiled blocks do not recompile when the number or lengths of segments in a micro-batch change."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.batch import positions_from_doc_lens
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
        positions = torch.from_numpy(positions_from_doc_lens(lens.numpy()))[None]
        out = model(ids, positions, lens)
        out.float().square().mean().backward()
        torch.testing.assert_close(out, eager(ids, positions, lens), atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_compile_as_one_graph_and_equal_eager(mode: str) -> None:
    """The order `parallelize` uses: activation checkpointing, then one graph per block (sdpa). The blocks must
    really compile (a forward torch.compile skips would fail with fullgraph=True) and give eager's loss,
    gradients and MoE counts (recorded once per forward, not again in the recompute)."""
    from torch._dynamo.utils import counters

    from lmforge.parallel.fsdp import apply_activation_checkpointing
    from tests.unit.test_moe import tiny_glm

    torch._dynamo.reset()
    counters.clear()
    models = [build_model(tiny_glm(), 256, "sdpa", torch.device("cpu")) for _ in range(2)]
    init_weights(models[0], 0.05, 0)
    models[1].load_state_dict(models[0].state_dict())
    compiled, eager = (m.train() for m in models)
    apply_activation_checkpointing(list(compiled.blocks), 1, mode)
    for block in compiled.blocks:
        block.compile(fullgraph=True)
    lens = torch.tensor([40, 56], dtype=torch.int32)
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(1))
    positions = torch.from_numpy(positions_from_doc_lens(lens.numpy()))[None]
    losses = []
    for model in (compiled, eager):
        out = model(ids, positions, lens)
        out.float().square().mean().backward()
        losses.append(out)
    assert counters["stats"]["unique_graphs"] >= 2, "a graph per kind of block: the dense one, the MoE ones"
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in eager.named_parameters()}
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-4, rtol=1e-4, msg=name)
    for got, want in zip(compiled.moe_layers().values(), eager.moe_layers().values(), strict=True):
        assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
