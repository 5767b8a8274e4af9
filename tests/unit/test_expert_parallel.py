"""Expert parallelism's dispatch on two gloo ranks: a token copy sent to the rank holding its expert gets the output
and the gradients it gets when every expert is local, also when a rank routes no token, receives none, or an
expert gets none; the checkpoint view presents whole stacks; under HSDP the expert stacks shard within a replica
group and replicate across groups; the config checks name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.config.checks import expert_problems
from tests.spawn import free_port, join_as_rank, run_ranks

E, H, INTER, K = 4, 16, 16, 2

CASES = {
    "random": ([7, 5], None),
    "rank 1 routes nothing": ([9, 0], None),
    # Every copy goes to experts 0 and 1 (rank 0's): rank 1 receives nothing, experts 2 and 3 get nothing.
    "one rank's experts only": ([6, 4], [0, 1]),
}


def _inputs(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, only = CASES[case]
    gen = torch.Generator().manual_seed(100 * rank + len(case))
    t = tokens[rank]
    x = torch.randn(t, H, generator=gen)
    choices = torch.tensor(only) if only is not None else torch.arange(E)
    pick = torch.stack([torch.randperm(len(choices), generator=gen)[:K] for _ in range(t)]) if t else None
    indices = choices[pick] if pick is not None else torch.empty(0, K, dtype=torch.int64)
    weights = torch.rand(t, K, generator=gen)
    grad_out = torch.randn(t, H, generator=gen)
    return x, indices, weights, grad_out


def _experts(impl: str) -> torch.nn.Module:
    from lmforge.model.moe import Experts

    torch.manual_seed(0)
    experts = Experts(E, H, INTER)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    experts.impl = impl  # type: ignore[assignment]
    return experts


def _run(experts: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    out, counts = experts(x, idx, w)
    (out * g).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "counts": counts}


def _worker(rank: int, port: int, folder: str, impl: str) -> None:
    join_as_rank(rank, port)
    import torch.distributed as dist

    from lmforge.parallel.experts import ExpertShard, shard_experts

    dist.init_process_group("gloo")
    try:
        result = {}
        for case in CASES:
            mine = _inputs(case, rank)
            local = _run(_experts(impl), *mine)
            sharded = _experts(impl)
            shard_experts(sharded, ExpertShard(dist.group.WORLD, rank, 2))
            remote = _run(sharded, *mine)
            # The reference weight gradient: every rank's copies through the whole stacks in one process.
            whole = _experts(impl)
            for r in range(2):
                x, idx, w, g = _inputs(case, r)
                out, _ = whole(x, idx, w)
                (out * g).sum().backward()
            half = slice(rank * E // 2, (rank + 1) * E // 2)
            result[case] = {
                "out": torch.allclose(remote["out"], local["out"], atol=1e-6),
                "x_grad": remote["x_grad"] is None or torch.allclose(remote["x_grad"], local["x_grad"], atol=1e-6),
                "counts": torch.equal(remote["counts"], local["counts"]),
                "w_grad": all(
                    torch.allclose(getattr(sharded, n).grad, getattr(whole, n).grad[half], atol=1e-5)
                    for n in ("gate_up_proj", "down_proj")
                ),
                "computed": float(sharded.tokens_computed),
            }
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_remote_experts_give_the_local_outputs_and_gradients(tmp_path: Path, impl: str) -> None:
    ranks = run_ranks(_worker, (free_port(), str(tmp_path), impl), tmp_path, timeout=120)
    for case in CASES:
        for rank, result in enumerate(ranks):
            assert all(result[case][k] for k in ("out", "x_grad", "counts", "w_grad")), (case, rank, result[case])
        # Each rank computed the copies routed to its experts, from both ranks.
        routed = [_inputs(case, r)[1] for r in range(2)]
        want = [sum(int(((idx >= r * E // 2) & (idx < (r + 1) * E // 2)).sum()) for idx in routed) for r in range(2)]
        assert [ranks[r][case]["computed"] for r in range(2)] == want, case
    assert ranks[1]["one rank's experts only"]["computed"] == 0


def test_expert_parallel_checks_name_the_field() -> None:
    from lmforge.config.train import TrainConfig

    base = {
        "model": {"arch": {"model_type": "glm4_moe", "hidden_size": 64, "intermediate_size": 128,
                           "moe_intermediate_size": 32, "n_routed_experts": 6, "num_experts_per_tok": 2,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}},
        "data": {"type": "fake", "seq_len": 64, "batch_tokens": 1024, "micro_batch_tokens": 256},
        "max_steps": 2, "output_dir": "unused", "optim": {"lr": 1e-3},
    }  # fmt: skip
    moe = TrainConfig.model_validate({**base, "parallel": {"ep": 4}})
    assert expert_problems(moe, 4) == [("parallel.ep", "4 does not divide the 6 routed experts per MoE block")]
    assert expert_problems(moe, 6)[0] == ("parallel.ep", "4 does not divide the world size 6")
    ok = TrainConfig.model_validate({**base, "parallel": {"ep": 2}})
    assert expert_problems(ok, 4) == []
    dense = TrainConfig.model_validate(
        {**base, "model": {"arch": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "max_position_embeddings": 256}}, "parallel": {"ep": 2}}
    )  # fmt: skip
    assert "needs a mixture-of-experts model" in expert_problems(dense, 2)[0][1]
    # selective checkpointing stops in the first backward when each rank's experts are unsharded (ep = world size)
    selective = {**base, "parallel": {"ep": 2}}
    selective["model"] = {**base["model"], "ac": {"mode": "selective"}}
    refused = TrainConfig.model_validate(selective)
    assert [field for field, _ in expert_problems(refused, 2)] == ["model.ac.mode"]
    assert expert_problems(refused, 4) == []
    # under HSDP each replica group holds whole expert-parallel groups
    hybrid = TrainConfig.model_validate({**base, "parallel": {"ep": 2, "dp_replicate": 4}})
    assert expert_problems(hybrid, 8) == []
    assert expert_problems(hybrid, 4) == [("parallel.ep", "2 does not divide a replica group's 1 ranks (world size "
                                           "/ parallel.dp_replicate = 4)")]  # fmt: skip


def _expert_mesh_worker(_: int, out: str) -> None:
    # rank 5 of 8 with ep 2 and 2 replica groups of 4 ranks (0-3, 4-7), on a fake process group of its own process
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lmforge.parallel.process_group import _expert_shard

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    shard = _expert_shard(torch.device("cpu"), 8, 5, ep=2, dp_replicate=2)
    plain = _expert_shard(torch.device("cpu"), 8, 5, ep=2)
    found = {
        "ep": [shard.rank, shard.size, dist.get_process_group_ranks(shard.group)],
        "fsdp_dims": list(shard.fsdp_mesh.mesh_dim_names),
        "fsdp": shard.fsdp_mesh.mesh.tolist(),
        "layout": shard.layout.mesh.tolist(),
        "plain_fsdp": plain.fsdp_mesh.mesh.tolist(),
    }
    dist.destroy_process_group()
    Path(out, "rank0.json").write_text(json.dumps(found))


def test_expert_stacks_replicate_over_hsdp_replica_groups(tmp_path: Path) -> None:
    (found,) = run_ranks(_expert_mesh_worker, (str(tmp_path),), tmp_path, timeout=120, n=1)
    assert found["ep"] == [1, 2, [4, 5]]
    # FSDP shards the experts within the replica group (ranks 5 and 7 hold experts 2-3) and replicates across
    # groups (1 and 5 hold the same rows)
    assert found["fsdp_dims"] == ["ereplicate", "eshard"] and found["fsdp"] == [[1, 3], [5, 7]]
    # checkpoints place the rows in the whole stack: expert blocks outermost, then replicas, then FSDP shards
    assert found["layout"] == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    assert found["plain_fsdp"] == [1, 3, 5, 7]
