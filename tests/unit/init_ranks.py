"""Run under torchrun: build a tiny model on the meta device, shard it over the ranks, initialize it, and write
the full weights (gathered on every rank) to OUT/rank_<r>.pt. Used by test_init.py.

`init_ranks.py OUT` builds a tiny Llama; `init_ranks.py OUT EP` a tiny GLM-4.5-style MoE whose experts are split
over EP ranks (parallel.ep), gathered as whole stacks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmforge.config.arch import Glm4MoeArch, LlamaArch
from lmforge.config.model import ModelConfig
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.parallel.experts import global_view
from lmforge.parallel.fsdp import parallelize
from lmforge.parallel.process_group import init_distributed, shutdown_distributed

MOE = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 72, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "max_position_embeddings": 512}  # fmt: skip
"""A tiny MoE whose expert matrices (144 and 64 rows) span several init blocks and uneven ones."""

if __name__ == "__main__":
    ep = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    ctx = init_distributed(ep=max(ep, 1))
    try:
        if ep:
            arch = Glm4MoeArch(**MOE)
        else:
            # The conftest's tiny Llama with 136 MLP rows (uneven shards); the test builds the same one.
            arch = LlamaArch(hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
        model = build_model(arch, 200, "sdpa", ctx.device, meta=True)
        # bf16 parameters put the model under FSDP2 on any world size.
        model = parallelize(model, model.blocks, ModelConfig(arch=arch, param_dtype="bfloat16"), ctx)
        init_weights(model, 0.02, seed=7, truncate=True)
        params = global_view(dict(model.named_parameters()), model)
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in params.items()}
        torch.save(full, Path(sys.argv[1]) / f"rank_{ctx.rank}.pt")
    finally:
        shutdown_distributed()
