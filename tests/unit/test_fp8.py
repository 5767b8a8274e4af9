"""FP8 training (`model.fp8`) through torchao's float8 emulation on the CPU: loss parity with the high-precision run,
which layers convert, unchanged names, the device checks, and FSDP on two processes with float8 all-gather and an
exact resume."""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmforge.config.loader import ConfigError
from lmforge.model import build_model
from lmforge.model.fp8 import apply_fp8, check_fp8_device, describe_fp8, fp8_layers
from lmforge.parallel.process_group import DistContext, init_distributed
from lmforge.train.trainer import Trainer
from tests.conftest import require, tiny_llama
from tests.integration.runner import losses, run_cli, write_config
from tests.unit.test_host_sync import _config
from tests.unit.test_moe import tiny_glm

require("torchao.float8")  # outside CI, skips where torchao is missing or built for another torch

CPU = torch.device("cpu")
STEPS = 20
FP8_RTOL = 2e-3
"""Relative loss difference allowed between emulated FP8 and high precision (see the parity test)."""


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def _losses(ctx: DistContext, tmp: Path, fp8: str) -> tuple[list[float], str]:
    model = {"arch": tiny_llama().model_dump(), "fp8": fp8, "fp8_emulate": fp8 != "none"}
    config = _config(tmp / fp8, max_steps=STEPS, model=model, data={"pattern": "counting"})
    trainer = Trainer(config, ctx, console=False)
    try:
        return [trainer.train_step(trainer.data.next_step(), 0.0)["loss/mean"] for _ in range(STEPS)], describe_fp8(
            trainer.model
        )
    finally:
        trainer.close()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_tracks_the_high_precision_run(
    ctx: DistContext, tmp_path: Path, one_thread: None, recipe: str
) -> None:
    reference, none = _losses(ctx, tmp_path, "none")
    fp8, described = _losses(ctx, tmp_path, recipe)
    assert none == "" and described == f"fp8 {recipe} on 14 linear layers, emulated"
    # Why FP8_RTOL = 2e-3: e4m3 keeps 3 mantissa bits, so each cast rounds an element by up to 2^-4 relative; over
    # dot products of 64-128 terms these roundings mostly cancel, and the step's loss averages 256 tokens. Measured
    # here: at most 3.5e-4 relative over the 20 steps for either recipe. A scale applied wrongly or not at all
    # scales the matmul outputs by whole factors and moves the loss far past it. The casts happening is checked below.
    relative = [abs(a - b) / b for a, b in zip(fp8, reference, strict=True)]
    assert max(relative) < FP8_RTOL, relative
    assert fp8 != reference  # the casts did happen
    assert reference[0] - reference[-1] > 0.3 and fp8[0] - fp8[-1] > 0.3


def test_only_block_linears_with_aligned_dims_convert_and_names_stay(ctx: DistContext) -> None:
    # An MoE model with one dense layer, shared experts, and an unaligned intermediate size (40) in the dense MLP.
    arch = tiny_glm(intermediate_size=40, n_shared_experts=1)
    plain = build_model(arch, 128, "sdpa", CPU)
    model = build_model(arch, 128, "sdpa", CPU)
    converted = apply_fp8(model.model.layers, "tensorwise", emulate=True, fsdp_all_gather=False)
    # Layer 0: attention only (its MLP's 64 -> 40 -> 64 is unaligned); layers 1-2: attention and the shared experts
    # (64 -> 32 -> 64); never the router, the routed experts (3-D weights) or the LM head.
    attention = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    shared = ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]
    expected = [f"0.{n}" for n in attention] + [f"{i}.{n}" for i in (1, 2) for n in attention + shared]
    assert sorted(converted) == sorted(expected)
    assert len(fp8_layers(model)) == len(expected)
    assert type(model.lm_head) is torch.nn.Linear
    assert list(model.state_dict()) == list(plain.state_dict())


def test_fp8_without_fp8_hardware_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"model.fp8 = 'tensorwise' needs a CUDA GPU .* set model.fp8_emulate"):
        check_fp8_device("tensorwise", emulate=False, device=CPU)
    check_fp8_device("tensorwise", emulate=True, device=CPU)
    check_fp8_device("none", emulate=False, device=CPU)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"compute capability >= 8.9.*A100-SXM4-80GB has 8.0"):
        check_fp8_device("rowwise", emulate=False, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device("rowwise", emulate=False, device=torch.device("cuda", 0))


def test_missing_or_mismatched_torchao_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(tiny_llama(), 128, "sdpa", CPU)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
        with pytest.raises(ConfigError, match=r"model.fp8 needs torchao \(pip install torchao\)"):
            apply_fp8(model.model.layers, "tensorwise", emulate=True, fsdp_all_gather=False)
    real_import = builtins.__import__

    def built_for_another_torch(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("torchao"):
            raise ImportError("cannot import name 'ScalingType' from 'torch.nn.functional'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", built_for_another_torch)
    with pytest.raises(ConfigError, match=r"torchao does not import with torch .*ScalingType.*release made for"):
        apply_fp8(model.model.layers, "tensorwise", emulate=True, fsdp_all_gather=False)


def test_fp8_run_on_the_cpu_without_emulation_exits_with_the_message(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "run", max_steps=2)
    result = run_cli(["train", "@", str(cfg), "--model.fp8", "rowwise"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model.fp8 = 'rowwise' needs a CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_two_processes_all_gather_float8_resume_exactly_and_save_plain_tensors(tmp_path: Path) -> None:
    flags = ["--model.fp8", "tensorwise", "--model.fp8-emulate", "true"]
    cfg = write_config(tmp_path, "straight", max_steps=6)
    runs = {}
    for name, nproc in (("one", 1), ("two", 2)):
        out = tmp_path / name
        result = run_cli(["train", "@", str(cfg), *flags, "--output-dir", str(out), "--ckpt.interval", "3"], nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = losses(out)
    log = (tmp_path / "two" / "logs" / "rank_0.log").read_text()
    assert "fp8 tensorwise on 14 linear layers, emulated, float8 all-gather" in log
    # The same micro-batches, split over two ranks: the first step (same weights, same float8 scales) is equal bit for
    # bit. Later steps start from weights that differ in the order of fp32 gradient sums, which can flip a float8
    # rounding, so they agree to the parity tolerance.
    assert runs["one"][0] == runs["two"][0]
    assert max(abs(a - b) / b for a, b in zip(runs["one"], runs["two"], strict=True)) < FP8_RTOL
    again = tmp_path / "again"
    resume = ["--resume.path", str(tmp_path / "two"), "--resume.step", "3", "--output-dir", str(again)]
    result = run_cli(["train", "@", str(cfg), *flags, *resume], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(again) == runs["two"][3:]
    # The files hold plain tensors: without FP8 the run resumes (in high precision now), and it exports.
    checkpoint = tmp_path / "two" / "checkpoints" / "step_3"
    assert not any(b"torchao" in f.read_bytes() for f in checkpoint.glob("*.distcp"))
    plain = ["--resume.path", str(tmp_path / "two"), "--resume.step", "3", "--output-dir", str(tmp_path / "plain")]
    result = run_cli(["train", "@", str(cfg), *plain], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(abs(a - b) / b for a, b in zip(losses(tmp_path / "plain"), runs["two"][3:], strict=True)) < FP8_RTOL
    result = run_cli(["export", str(tmp_path / "two"), "--output", str(tmp_path / "hf")])
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_compiled_blocks_train_with_fp8(ctx: DistContext, tmp_path: Path, one_thread: None) -> None:
    model = {"arch": tiny_llama().model_dump(), "fp8": "tensorwise", "fp8_emulate": True}
    results = []
    for compiled in (False, True):
        config = _config(tmp_path / str(compiled), max_steps=3, model={**model, "compile": compiled})
        trainer = Trainer(config, ctx, console=False)
        try:
            results.append([trainer.train_step(trainer.data.next_step(), 0.0)["loss/mean"] for _ in range(3)])
            assert len(fp8_layers(trainer.model)) == 14
        finally:
            trainer.close()
    eager, compiled_losses = results
    assert max(abs(a - b) / b for a, b in zip(eager, compiled_losses, strict=True)) < FP8_RTOL


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_fp8_matmuls_track_bf16(ctx: DistContext, tmp_path: Path, recipe: str) -> None:
    if ctx.device.type != "cuda":
        pytest.skip("the process group of this module was started on the CPU")
    if torch.cuda.get_device_capability(ctx.device) < (8, 9):
        pytest.skip("no FP8 tensor cores on this GPU")
    runs = {}
    for fp8 in ("none", recipe):
        # bf16 parameters: FSDP wraps the one rank, so tensorwise all-gathers float8 weights (scales precomputed).
        model = {"arch": tiny_llama(hidden_size=128, intermediate_size=256).model_dump(), "fp8": fp8, "compile": True}
        config = _config(tmp_path / fp8, max_steps=10, model=model, data={"pattern": "counting"})
        trainer = Trainer(config, ctx, console=False)
        try:
            runs[fp8] = [trainer.train_step(trainer.data.next_step(), 0.0)["loss/mean"] for _ in range(10)]
            assert trainer.fp8_all_gather == (recipe == "tensorwise" and fp8 != "none")
        finally:
            trainer.close()
    # bf16 itself keeps 8 mantissa bits, so both runs carry rounding noise; FP8's adds to it (twice the CPU bound).
    assert max(abs(a - b) / b for a, b in zip(runs[recipe], runs["none"], strict=True)) < 2 * FP8_RTOL
