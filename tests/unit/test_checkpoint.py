"""Checkpoint pieces in one process: retention rule, resolving a resume request, shape checks, loading without a
process group, and that an async save captures the state at the moment it was asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.checkpoint.layout import CheckpointError, find_checkpoint, list_checkpoints, read_latest, retained
from lmforge.checkpoint.load import check_model_shapes, load_checkpoint, load_model_weights
from lmforge.config.ckpt import CkptConfig
from lmforge.config.model import ModelConfig
from lmforge.config.optim import AdamWConfig
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.optim import build_optimizer
from lmforge.parallel.fsdp import parallelize
from lmforge.parallel.process_group import DistContext, init_distributed
from tests.conftest import tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_interval", "kept"),
    [
        ([1, 2, 3, 4, 5], 2, None, {4, 5}),
        ([1, 2, 3, 4, 5], 1, 2, {2, 4, 5}),
        ([10, 20, 30], 5, None, {10, 20, 30}),
        ([3, 6, 9, 12], 1, 4, {12}),
        ([5, 100, 105], 1, 50, {100, 105}),
    ],
)
def test_retention_rule(steps: list[int], keep_last: int, keep_interval: int | None, kept: set[int]) -> None:
    assert retained(steps, keep_last, keep_interval) == kept


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(tiny_llama(), 256, "sdpa", CPU)
    init_weights(model, 0.02, seed)
    optimizer = build_optimizer(model, AdamWConfig(lr=1e-2))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(seed))
    model(ids, torch.arange(32)[None], torch.tensor([32], dtype=torch.int32)).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _save(ctx: DistContext, run: Path, step: int, async_save: bool = False, **kw: object) -> Checkpointer:
    model, optimizer = kw.pop("trained", None) or _trained()  # type: ignore[misc]
    ckpt = Checkpointer(run, CkptConfig(async_save=async_save, **kw), ctx, {})  # type: ignore[arg-type]
    ckpt.save(step, model, optimizer, {"tokens_seen": 0, "schedule_start": 0, "data": {"windows": step}})
    ckpt.close()
    return ckpt


def test_save_commits_then_names_latest(ctx: DistContext, tmp_path: Path) -> None:
    _save(ctx, tmp_path, 3)
    root = tmp_path / "checkpoints"
    assert read_latest(root) == 3 and list_checkpoints(root) == [3]
    assert not list(root.glob(".tmp_*"))
    assert find_checkpoint(tmp_path, "latest") == root / "step_3"
    assert find_checkpoint(tmp_path, 3) == root / "step_3"
    assert find_checkpoint(root / "step_3", "latest") == root / "step_3"


def test_resume_requests_that_cannot_be_met(ctx: DistContext, tmp_path: Path) -> None:
    assert find_checkpoint(tmp_path, "auto") is None
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        find_checkpoint(tmp_path, "latest")
    _save(ctx, tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 5 .*complete checkpoints: 2"):
        find_checkpoint(tmp_path, 5)
    root = tmp_path / "checkpoints"
    (root / "step_2" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="step_2 is missing or incomplete"):
        find_checkpoint(tmp_path, "latest")
    with pytest.raises(CheckpointError, match="incomplete"):
        find_checkpoint(root / "step_2", "latest")


def test_leftover_of_an_interrupted_save_is_cleared(ctx: DistContext, tmp_path: Path) -> None:
    leftover = tmp_path / "checkpoints" / ".tmp_step_7"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    _save(ctx, tmp_path, 8)
    assert not leftover.exists() and list_checkpoints(tmp_path / "checkpoints") == [8]


def test_async_save_keeps_the_state_of_the_moment_it_was_taken(ctx: DistContext, tmp_path: Path) -> None:
    model, optimizer = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path, CkptConfig(async_save=True), ctx, {})
    ckpt.save(1, model, optimizer, {"tokens_seen": 0, "schedule_start": 0, "data": {}})
    with torch.no_grad():  # training goes on while the files are written
        for p in model.parameters():
            p.add_(1.0)
    ckpt.close()
    fresh = build_model(tiny_llama(), 256, "sdpa", CPU)
    load_model_weights(tmp_path / "checkpoints" / "step_1", fresh)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_sharded_save_and_load_restore_model_and_optimizer(ctx: DistContext, tmp_path: Path, param_dtype: str) -> None:
    """On the run's device; bf16 parameters put the model under FSDP2 even on one rank (DTensor state)."""
    cfg = ModelConfig(arch=tiny_llama(), param_dtype=param_dtype)  # type: ignore[arg-type]

    def build(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(tiny_llama(), 256, "sdpa", ctx.device)
        init_weights(model, 0.02, seed=int(lr * 1000))
        model = parallelize(model, model.blocks, cfg, ctx)
        return model, build_optimizer(model, AdamWConfig(lr=lr))

    model, optimizer = build(1e-2)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    logits = model(ids, torch.arange(32, device=ctx.device)[None], torch.tensor([32], dtype=torch.int32))
    logits.float().square().mean().backward()
    optimizer.step()
    _save(ctx, tmp_path, 4, trained=(model, optimizer))
    fresh, fresh_opt = build(5e-3)
    state = load_checkpoint(tmp_path / "checkpoints" / "step_4", fresh, fresh_opt, rank=0)
    assert state["step"] == 4 and state["data"] == {"windows": 4}

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(full(a), full(b)), name
        assert torch.equal(full(optimizer.state[a]["exp_avg_sq"]), full(fresh_opt.state[b]["exp_avg_sq"])), name
    # Hyperparameters follow the current config, not the checkpoint.
    assert {g["lr"] for g in fresh_opt.param_groups} == {5e-3}


def test_a_checkpoint_of_another_shape_is_refused_by_name(ctx: DistContext, tmp_path: Path) -> None:
    _save(ctx, tmp_path, 1)
    other = build_model(tiny_llama(intermediate_size=96, tie_word_embeddings=True), 256, "sdpa", CPU)
    with pytest.raises(CheckpointError) as info:
        check_model_shapes(tmp_path / "checkpoints" / "step_1", other)
    message = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight: checkpoint shape [128, 64], model shape [96, 64]" in message
    assert "does not fit the configured model" in message


def test_resuming_in_the_own_run_dir_keeps_one_curve(ctx: DistContext, tmp_path: Path) -> None:
    from lmforge.checkpoint.run_dir import prepare_output_dir
    from lmforge.config import ConfigError, load_train_config
    from tests.integration.runner import write_config

    cfg = write_config(tmp_path, "run")
    run = tmp_path / "run"
    _save(ctx, run, 2)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3)))
    step_dir = str(run / "checkpoints" / "step_2")
    config, _ = load_train_config(["@", str(cfg), "--resume.path", step_dir, "--resume.step", "2"])
    with pytest.raises(ConfigError, match="cannot be combined"):
        prepare_output_dir(config, overwrite=True)  # would delete the checkpoint it resumes from
    assert prepare_output_dir(config, overwrite=False) == run / "checkpoints" / "step_2"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
