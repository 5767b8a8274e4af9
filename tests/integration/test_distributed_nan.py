"""A non-finite micro-batch on one rank only: both ranks skip it in step, no collective hangs (also under expert
parallelism, where the poisoned rank's token copies reach the other rank's experts, and under pipeline
parallelism, where the first stage's NaN shows only in the last stage's loss)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_llama
from tests.spawn import free_port, join_as_rank, run_ranks
from tests.unit.test_micro_batches import make_batches, poisoned_vs_clean, train_config

pytestmark = pytest.mark.slow

PIPELINE = -1
"""The `ep` parameter of the case that runs the two ranks as two pipeline stages instead."""


MOE_ARCH = {"model_type": "glm4_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 256}  # fmt: skip


def _worker(rank: int, port: int, tmp: str, ep: int) -> None:
    join_as_rank(rank, port)
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed

    data = {"type": "fake", "seq_len": 32, "batch_tokens": 256, "micro_batch_tokens": 64, "vocab_size": 100}
    if ep == PIPELINE:
        # the two ranks are two stages of the same rows (4 micro-batches of 64 tokens a step): the first stage's
        # second one of step 1 goes NaN, which only the last stage's loss shows
        ctx = init_distributed(timeout_minutes=2, pp=2)
        config = train_config(Path(tmp), data=data, model={"arch": tiny_llama(num_hidden_layers=4).model_dump()},
                              parallel={"pp": 2})  # fmt: skip
        batches = [make_batches(4, t=64, seed=10 * s) for s in range(3)]
        result = poisoned_vs_clean(config, ctx, batches, bad=(1, 1))
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
        shutdown_distributed()
        return
    ctx = init_distributed(timeout_minutes=2, ep=max(ep, 1))
    extra = {} if ep == 0 else {"model": {"arch": MOE_ARCH}, "parallel": {"ep": ep}}
    config = train_config(Path(tmp), data=data, **extra)
    # each rank holds 2 micro-batches of 64 tokens per step; rank 0's second one of step 1 goes NaN
    batches = [make_batches(2, seed=10 * s + rank) for s in range(3)]
    result = poisoned_vs_clean(config, ctx, batches, bad=(1, 1) if rank == 0 else None)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_distributed()


@pytest.mark.parametrize("ep", [0, 1, 2, PIPELINE], ids=["dense", "moe", "moe-ep2", "pp2"])
def test_nan_on_one_rank_is_skipped_everywhere(tmp_path: Path, ep: int) -> None:
    results = run_ranks(_worker, (free_port(), str(tmp_path), ep), tmp_path, timeout=180)
    assert results[0]["hits"] == 1 and results[1]["hits"] == 0
    for res in results:
        assert [m["loss/nan_count"] for m in res["metrics"]] == [0.0, 1.0, 0.0]
        assert [m["loss/mean"] for m in res["metrics"]] == [m["loss/mean"] for m in res["ref"]]
        assert res["same_params"]
    assert results[0]["metrics"] == results[1]["metrics"]
