"""The step loop's core on one process: accumulation equals the full-batch mean, overfitting, NaN skipping."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.checkpoint.run_dir import prepare_output_dir
from lmforge.config import TrainConfig
from lmforge.data.batch import MicroBatch, null_micro_batch
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.monitor import read_metrics
from lmforge.parallel.process_group import DistContext, init_distributed
from lmforge.train.micro_batches import run_micro_batches
from lmforge.train.trainer import Trainer
from tests.conftest import tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    # A process group of one, as a plain `lmforge train` starts; shared by this module's trainer tests.
    yield init_distributed()


def train_config(tmp_path: Path, **overrides: object) -> TrainConfig:
    raw: dict[str, object] = {
        "max_steps": 4,
        "output_dir": str(tmp_path / "run"),
        "model": {"arch": tiny_llama().model_dump()},
        "data": {"type": "fake", "seq_len": 32, "batch_tokens": 256, "micro_batch_tokens": 64, "vocab_size": 100},
        "optim": {"lr": 1e-3},
        "schedule": {"warmup": 0.0, "decay": 0.0},
    }
    raw.update(overrides)
    return TrainConfig.model_validate(raw)


def make_batches(n: int, t: int = 32, vocab: int = 100, seed: int = 0) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (1, t + 1), generator=g)
        mask = torch.rand(1, t, generator=g) > 0.3
        out.append(
            MicroBatch(
                input_ids=ids[:, :-1],
                target_ids=ids[:, 1:],
                position_ids=torch.arange(t)[None],
                loss_mask=mask,
                doc_lens=torch.tensor([t], dtype=torch.int32),
            )
        )
    return out


def test_accumulated_gradient_is_the_mean_over_all_loss_tokens(ctx: DistContext, one_thread: None) -> None:
    model = build_model(tiny_llama(), 128, "sdpa", CPU)
    init_weights(model, 0.02, 0)
    batches = make_batches(3)
    stats = run_micro_batches(model, batches, CPU)
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # reference: one forward over the concatenated rows, mean over all loss tokens
    logits = torch.cat([model(b.input_ids, b.position_ids, b.doc_lens) for b in batches], dim=1)
    targets = torch.cat([b.target_ids for b in batches], dim=1)
    mask = torch.cat([b.loss_mask for b in batches], dim=1)
    ce = F.cross_entropy(logits[0].float(), targets[0], reduction="none")
    loss = ce[mask[0]].mean()
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(accumulated[n], p.grad, atol=1e-6, rtol=1e-5)
    assert abs(float(stats.loss_sum) / float(stats.loss_tokens) - loss.item()) < 1e-5
    assert int(stats.tokens) == 96 and int(stats.nan_count) == 0


def test_tiny_model_overfits_a_fixed_batch(ctx: DistContext, tmp_path: Path) -> None:
    config = train_config(tmp_path, max_steps=60, optim={"lr": 1e-2, "weight_decay": 0.0})
    trainer = Trainer(config, ctx, console=False)
    fixed = make_batches(2, t=64)
    losses = [trainer.train_step(fixed, 0.0)["loss/mean"] for _ in range(60)]
    trainer.close()
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


class _Poison:
    """Forward hook on the embedding that turns the output NaN for one chosen micro-batch's tokens."""

    def __init__(self, poisoned: torch.Tensor | None) -> None:
        self.poisoned = poisoned
        self.hits = 0

    def __call__(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        if self.poisoned is not None and torch.equal(args[0], self.poisoned[0]):
            self.hits += 1
            return out * float("nan")
        return out


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in trainer.model.named_parameters()}  # fmt: skip


def poisoned_vs_clean(
    config: TrainConfig, ctx: DistContext, batches: list[list[MicroBatch]], bad: tuple[int, int] | None
) -> dict[str, object]:
    """Train on `batches` with micro-batch `bad` = (step, index) turned NaN, and again with it replaced by an empty
    loss mask (which adds nothing); returns both runs' metrics, the poison hits and whether the weights agree."""
    poisoned = Trainer(config, ctx, console=False)
    hook = _Poison(batches[bad[0]][bad[1]].input_ids if bad else None)
    if poisoned.model.model.embed_tokens is not None:  # under pipeline parallelism, on the first stage's rank only
        poisoned.model.model.embed_tokens.register_forward_hook(hook)
    metrics = [poisoned.train_step(b, 0.0) for b in batches]
    got = _params(poisoned)
    poisoned.close()

    reference = Trainer(config, ctx, console=False)
    clean = [list(b) for b in batches]
    if bad:
        clean[bad[0]][bad[1]] = null_micro_batch(clean[bad[0]][bad[1]])
    ref_metrics = [reference.train_step(b, 0.0) for b in clean]
    want = _params(reference)
    reference.close()
    same = all(torch.equal(got[n], want[n]) for n in want)
    return {"metrics": metrics, "ref": ref_metrics, "same_params": same, "hits": hook.hits}


def test_nonfinite_micro_batch_is_skipped_and_counted(ctx: DistContext, tmp_path: Path, one_thread: None) -> None:
    batches = [make_batches(4, seed=s) for s in range(3)]
    result = poisoned_vs_clean(train_config(tmp_path), ctx, batches, bad=(1, 2))
    metrics, ref_metrics = result["metrics"], result["ref"]
    assert result["hits"] == 1
    assert [m["loss/nan_count"] for m in metrics] == [0.0, 1.0, 0.0]
    for m, r in zip(metrics, ref_metrics, strict=True):
        assert m["loss/mean"] == r["loss/mean"]
        assert m["optim/grad_norm"] == r["optim/grad_norm"]
    assert result["same_params"]


def test_output_dir_refuses_to_mix_runs(tmp_path: Path) -> None:
    from lmforge.config import ConfigError

    config = train_config(tmp_path)
    assert prepare_output_dir(config, overwrite=False) is None  # nothing to resume from
    out = Path(config.output_dir)
    assert (out / "config.toml").exists()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_output_dir(config, overwrite=False)
    prepare_output_dir(config, overwrite=True)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_trainer_writes_metrics_with_design_names(ctx: DistContext, tmp_path: Path) -> None:
    config = train_config(tmp_path, max_steps=3)
    prepare_output_dir(config, overwrite=False)
    Trainer(config, ctx, console=False).train()
    records = read_metrics(Path(config.output_dir) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    params = {"params/total", "params/embedding", "params/non_embedding", "params/active_non_embedding"}
    assert params <= set(records[0])
    for key in ("loss/mean", "loss/perplexity", "loss/nan_count", "loss/spike", "optim/lr", "optim/grad_norm",
                "optim/grad_norm_spike", "perf/throughput", "perf/throughput_per_device", "perf/peak_memory",
                "perf/peak_memory_mean", "time/step", "time/data/max", "time/data/mean", "progress/num_tokens",
                "progress/epoch"):  # fmt: skip
        assert key in records[-1], key
    assert "perf/mfu" not in records[-1], "no MFU without a known peak FLOP/s (CPU)"
    log = (Path(config.output_dir) / "logs" / "rank_0.log").read_text()
    assert "rank 0 of 1" in log and "step 3/3" in log
    assert records[-1]["progress/num_tokens"] == 3 * 256


def _losses(ctx: DistContext, config: TrainConfig, steps: int = 3) -> list[float]:
    trainer = Trainer(config, ctx, console=False)
    batches = [make_batches(2, seed=s) for s in range(steps)]
    out = [trainer.train_step(b, 0.0)["loss/mean"] for b in batches]
    trainer.close()
    return out


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_losses(
    ctx: DistContext, tmp_path: Path, one_thread: None, mode: str
) -> None:
    plain = _losses(ctx, train_config(tmp_path))
    model = {"arch": tiny_llama().model_dump(), "ac": {"mode": mode, "freq": 1}}
    assert _losses(ctx, train_config(tmp_path, model=model)) == plain


def _matmuls_in_backward(mode: str) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmforge.parallel.fsdp import apply_activation_checkpointing

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.n += 1
            return func(*args, **(kwargs or {}))

    model = build_model(tiny_llama(), 128, "sdpa", CPU)
    init_weights(model, 0.02, 0)
    if mode != "none":
        apply_activation_checkpointing(model.blocks, 1, mode)
    (mb,) = make_batches(1, vocab=128)
    loss = model(mb.input_ids, mb.position_ids, mb.doc_lens).float().square().mean()
    with Count() as count:
        loss.backward()
    return count.n


def test_selective_checkpointing_recomputes_no_matmul() -> None:
    none, full, selective = (_matmuls_in_backward(m) for m in ("none", "full", "selective"))
    # Full AC reruns the blocks' forward matmuls (up to the last one whose output backward needs: 6 of 7 per
    # block); selective AC kept their outputs and reruns none.
    assert full >= none + 2 * 6
    assert selective == none


def test_bf16_parameters_train_close_to_fp32(ctx: DistContext, tmp_path: Path) -> None:
    fp32 = _losses(ctx, train_config(tmp_path))
    bf16 = _losses(ctx, train_config(tmp_path, model={"arch": tiny_llama().model_dump(), "param_dtype": "bfloat16"}))
    assert fp32 != bf16
    assert max(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) < 0.05


@pytest.mark.slow
def test_compiled_blocks_match_eager(ctx: DistContext, tmp_path: Path, one_thread: None) -> None:
    eager = _losses(ctx, train_config(tmp_path), steps=2)
    model = {"arch": tiny_llama().model_dump(), "compile": True}
    compiled = _losses(ctx, train_config(tmp_path, model=model), steps=2)
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-4


@pytest.mark.gpu
def test_micro_batch_loop_never_syncs_with_the_host() -> None:
    device = torch.device("cuda")
    model = build_model(tiny_llama(), 128, "auto", device)
    init_weights(model, 0.02, 0)
    model.to(device)
    batches = [mb.pin_memory() for mb in make_batches(3)]
    run_micro_batches(model, batches, device)  # warm up kernels and caches outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_micro_batches(model, batches, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_cuda_run_in_bf16(ctx: DistContext, tmp_path: Path) -> None:
    if ctx.device.type != "cuda":
        pytest.skip("the process group of this module was started on the CPU")
    losses = _losses(ctx, train_config(tmp_path), steps=3)
    assert all(0 < x < 10 for x in losses)


def test_fsdp_over_one_rank_equals_the_unwrapped_model(ctx: DistContext, one_thread: None) -> None:
    # Why a single fp32 process runs unwrapped: FSDP over one rank gives bit-identical gradients.
    from torch.distributed.fsdp import fully_shard

    plain, sharded = (build_model(tiny_llama(), 128, "sdpa", CPU) for _ in range(2))
    for m in (plain, sharded):
        init_weights(m, 0.02, 0)
    for block in sharded.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(sharded, mesh=ctx.mesh)
    batches = make_batches(3)
    a = run_micro_batches(plain, batches, CPU)
    b = run_micro_batches(sharded, batches, CPU)
    assert torch.equal(a.loss_sum, b.loss_sum)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad.full_tensor()), name


@pytest.mark.parametrize("optim_type", ["muon", "adamw"])
def test_group_gradient_norms_add_up_to_the_clipped_total(
    ctx: DistContext, tmp_path: Path, one_thread: None, optim_type: str
) -> None:
    config = train_config(tmp_path, optim={"type": optim_type, "lr": 1e-3, "max_norm": 0.05})
    trainer = Trainer(config, ctx, console=False)
    batches = make_batches(4, seed=3)
    # An independent reference: torch's own total norm of the same gradients, from a copy of the model.
    reference = copy.deepcopy(trainer.model)
    run_micro_batches(reference, batches, CPU, False)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item()
    clipped = {}
    original_step = trainer.optimizer.step

    def capture() -> None:  # the gradients the optimizer sees, after clipping
        clipped["norm"] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))
        original_step()

    trainer.optimizer.step = capture  # type: ignore[method-assign]
    metrics = trainer.train_step(batches, 0.0)
    trainer.close()
    groups = {k.removeprefix("optim/grad_norm/"): v for k, v in metrics.items() if k.startswith("optim/grad_norm/")}
    expected_groups = {"hidden", "residual_out", "embed", "head", "norm"}
    assert set(groups) == expected_groups
    assert math.isclose(sum(v * v for v in groups.values()), metrics["optim/grad_norm"] ** 2, rel_tol=1e-9)
    assert math.isclose(metrics["optim/grad_norm"], expected, rel_tol=1e-5)
    assert expected > 0.05 and math.isclose(clipped["norm"].item(), 0.05, rel_tol=1e-4)
    lrs = {k for k in metrics if k.startswith("optim/lr/")}
    assert lrs == {f"optim/lr/{g}" for g in expected_groups}
