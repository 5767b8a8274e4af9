"""How pipeline parallelism cuts a model: balanced splits, which rank runs which stage, the model left on a rank,
and the config errors that name the field."""

from __future__ import annotations

import itertools
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from lmforge.config import ConfigError, load_train_config
from lmforge.model import build_model
from lmforge.model.llama import is_present
from lmforge.parallel.pipeline import split_stages
from lmforge.parallel.stages import PipeShard, balanced_split, stage_layers, stage_ranks
from tests.conftest import tiny_llama
from tests.integration.runner import write_config
from tests.unit.test_moe import tiny_glm


def brute_force_split(weights: list[float], stages: int, first: float, last: float) -> float:
    """The lightest heaviest stage over every contiguous split, from the definition."""
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        loads = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_split_is_the_lightest_heaviest_stage(seed: int) -> None:
    import random

    rng = random.Random(seed)
    weights = [rng.uniform(1, 10) for _ in range(rng.randint(4, 9))]
    stages = rng.randint(2, min(4, len(weights)))
    first, last = rng.uniform(0, 20), rng.uniform(0, 20)
    sizes = balanced_split(weights, stages, first, last)
    assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == len(weights)
    loads = [sum(weights[r.start : r.stop]) for r in stage_layers(sizes)]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(brute_force_split(weights, stages, first, last))


def test_a_heavy_embedding_moves_layers_off_the_first_stage() -> None:
    assert balanced_split([1.0] * 8, 2) == [4, 4]
    assert balanced_split([1.0] * 8, 2, first=4.0) == [2, 6]
    assert balanced_split([1.0] * 8, 4, last=2.0) == [2, 2, 3, 1]
    with pytest.raises(ValueError, match="3 layers do not split into 4"):
        balanced_split([1.0] * 3, 4)


def test_stage_ranks_loop_and_v() -> None:
    assert stage_ranks(2, 1, "1f1b") == [0, 1]
    assert stage_ranks(2, 2, "interleaved_1f1b") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "interleaved_zb") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_ranks(2, 2, "zbv") == [0, 1, 1, 0]  # the last stage comes back to rank 0: it computes the loss


def test_a_rank_keeps_only_its_stages_under_their_full_names() -> None:
    import torch

    from lmforge.config.parallel import ParallelConfig

    arch = tiny_llama(num_hidden_layers=4)
    parallel = ParallelConfig(pp=2, pp_schedule="zbv")
    names = {}
    for rank in range(2):
        model = build_model(arch, 128, "sdpa", torch.device("cpu"), meta=True)
        modules = split_stages(model, parallel, PipeShard(None, rank, 2, loss_rank=0))
        names[rank] = {n for n, _ in model.named_parameters()}
        assert [list(m.layer_indices) for m in modules] == ([[0], [3]] if rank == 0 else [[1], [2]])
        held = [i for i, layer in enumerate(model.model.layers) if is_present(layer)]
        assert held == ([0, 3] if rank == 0 else [1, 2])
        # the stage modules hold exactly the rank's parameters
        assert sum(p.numel() for m in modules for p in m.parameters()) == sum(p.numel() for p in model.parameters())
        for name in names[rank]:
            assert not model.held_elsewhere(name)
    whole = {n for n, _ in build_model(arch, 128, "sdpa", torch.device("cpu"), meta=True).named_parameters()}
    assert names[0] | names[1] == whole and not names[0] & names[1]
    assert "lm_head.weight" in names[0] and "model.embed_tokens.weight" in names[0]  # V: first and last on rank 0


@pytest.mark.parametrize(
    ("flags", "arch", "message"),
    [
        (
            ["--parallel.pp", "2", "--parallel.pp_layers", "[1, 2]"],
            None,
            r"parallel.pp_layers .*\[1, 2\] must give 2 "
            r"stages .* 4 in all",
        ),
        (
            ["--parallel.pp", "4", "--parallel.pp_schedule", "interleaved_1f1b"],
            None,
            r"parallel.pp .*4 x 2 stages per "
            r"rank = 8 stages need at least as many decoder layers; the model has 4",
        ),
        (
            ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.pp_stages_per_rank", "3"],
            None,
            r"parallel.pp_stages_per_rank .*the zbv schedule holds 2 stages per rank",
        ),
        (
            ["--parallel.pp", "2", "--parallel.tp", "4"],
            None,
            r"parallel.pp .*2 x parallel.dp_replicate x parallel.cp x parallel.tp = 8 does not divide the world size 4",
        ),
        (
            ["--parallel.pp", "2", "--data.batch_tokens", "256"],
            None,
            r"data.batch_tokens .*gives each data-parallel "
            r"rank 1 micro-batches a step; the 1f1b schedule needs at least parallel.pp = 2",
        ),
        (
            ["--parallel.pp", "2"],
            tiny_llama(num_hidden_layers=4, tie_word_embeddings=True),
            r"model.arch.tie_word_embeddings .*different stages",
        ),
        (["--parallel.pp", "2", "--model.z_loss", "1e-4"], None, r"model.z_loss .*does not run under parallel.pp"),
        (["--parallel.pp_layers", "[2, 2]"], None, r"parallel.pp_layers .*is set but parallel.pp is 1"),
        (
            ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--model.ac.mode", "selective"],
            None,
            r"model.ac.mode .*'selective' does not run with the zbv schedule",
        ),
        (
            ["--parallel.pp", "2", "--parallel.ep", "4"],
            tiny_glm(),
            r"parallel.ep .*4 does not divide a stage group's "
            r"2 ranks",
        ),
    ],
)
def test_pipeline_config_errors_name_the_field(tmp_path: Path, flags: list[str], arch: object, message: str) -> None:
    cfg = write_config(tmp_path, "run", arch=arch or tiny_llama(num_hidden_layers=4, max_position_embeddings=256))
    with pytest.raises(ConfigError, match=message):
        load_train_config(["@", str(cfg), *flags], 4)


@pytest.mark.slow  # each pipeline rank's plan runs in a process of its own
def test_plan_traces_every_pipeline_rank_and_refuses_the_schedules_it_cannot_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmforge.commands.plan import main
    from lmforge.plan.gpus import gpu_spec
    from lmforge.plan.ranks import plan_run
    from lmforge.plan.step import plan_step

    cfg = write_config(tmp_path, "run", arch=tiny_llama(num_hidden_layers=4, max_position_embeddings=256))
    flat, piped = tmp_path / "flat.json", tmp_path / "piped.json"
    assert main(["@", str(cfg), "--gpus", "4", "--vocab-size", "200", "--json", str(flat)]) == 0
    assert main(["@", str(cfg), "--gpus", "4", "--vocab-size", "200", "--parallel.pp", "2", "--json", str(piped)]) == 0
    one, two = (json.loads(p.read_text()) for p in (flat, piped))
    ranks = two["pipeline_ranks"]
    assert [r["layers"] for r in ranks] == ["layers 0-1", "layers 2-3"]
    assert all(r["peak_bytes"] > 0 and r["busy_seconds"] > 0 for r in ranks)
    assert two["peak_bytes"] == max(r["peak_bytes"] for r in ranks)
    assert two["step_seconds_estimate"] == pytest.approx(max(r["step_seconds"] for r in ranks))
    # 4 micro-batches per rank at pp 2 in 1F1B: (p - 1) / (m + p - 1), a fifth of the step idle in theory
    assert two["micro_batches"] == 4 and two["pipeline_bubble"] == pytest.approx(1 / 5)
    # a GPU's share of the step's tokens and FLOPs is 1 / world size whatever the layout (the attention FLOPs
    # differ with the rows each rank is dealt)
    assert two["tokens_per_step"] == one["tokens_per_step"]
    assert two["flops_6nd_per_step"] == pytest.approx(one["flops_6nd_per_step"])
    assert "pipeline" in two["choices"] and "pp 2 x dp 2" in two["choices"]["layout"]
    # 16 micro-batches per rank: traced at 4 and 8, extended to 16, the figures of the whole step's trace
    config, _ = load_train_config(["@", str(cfg), "--parallel.pp", "2", "--data.batch_tokens", "4096"], 4)
    extended = plan_run(config, 4, gpu_spec("h100"), 8, vocab_size=200)
    assert extended.micro_batches == 16 and any("extended every figure" in n for n in extended.notes)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1) as pool:
        whole = [pool.submit(plan_step, config, 4, gpu_spec("h100"), 8, None, 200, rank=r).result() for r in (0, 2)]
    for got, want in zip(extended.pipeline_ranks, whole, strict=True):
        assert got["peak_bytes"] == pytest.approx(want.peak_bytes, rel=1e-4)
        assert got["busy_seconds"] == pytest.approx(want.busy_seconds, rel=1e-4)
    capsys.readouterr()
    assert main(["@", str(cfg), "--gpus", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "zbv"]) == 2
    assert "parallel.pp_schedule = 'zbv': the plan traces 1f1b only" in capsys.readouterr().err
