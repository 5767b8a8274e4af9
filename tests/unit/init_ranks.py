"""Run under torchrun: build a tiny model on the meta device, shard it over the ranks, initialize it, and write
the full weights (gathered on every rank) to OUT/rank_<r>.pt. Used by test_init.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmforge.config.model import ModelConfig
from lmforge.model import build_model
from lmforge.model.config import LlamaArch
from lmforge.model.init import init_weights
from lmforge.parallel import init_distributed, parallelize, shutdown_distributed

if __name__ == "__main__":
    ctx = init_distributed()
    try:
        # The conftest's tiny Llama with 136 MLP rows (uneven shards); the test builds the same one.
        arch = LlamaArch(hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
        model = build_model(arch, 200, "sdpa", ctx.device, meta=True)
        # bf16 parameters put the model under FSDP2 on any world size.
        model = parallelize(model, model.blocks, ModelConfig(arch=arch, param_dtype="bfloat16"), ctx)
        init_weights(model, 0.02, seed=7, truncate=True)
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}
        torch.save(full, Path(sys.argv[1]) / f"rank_{ctx.rank}.pt")
    finally:
        shutdown_distributed()
