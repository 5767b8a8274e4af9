"""`lmforge plan --check-cuda`: a config's CUDA step on fake CUDA tensors, without a GPU (docs/plan.md).

Most of these need the CUDA build of torch. CI runs this file a second time in an environment that has it
(`.ci/run`), with `LMFORGE_CUDA_BUILD=required`, where a missing CUDA build fails them instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from lmforge.config import load_train_config
from lmforge.model import attention
from lmforge.model.norm import RMSNormFunction
from lmforge.plan.cuda_check import check_cuda, cuda_build_missing
from lmforge.plan.graph_backward import run_graph_backward
from tests.conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT)


def _needs_cuda_build() -> None:
    missing = cuda_build_missing()
    if missing is None:
        return
    if os.environ.get("LMFORGE_CUDA_BUILD") == "required":
        pytest.fail(f"LMFORGE_CUDA_BUILD=required, but {missing}")
    pytest.skip("needs the CUDA build of torch (CI runs it in a second environment)")


def _check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "check.json"
    env = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "lmforge", "plan", "--check-cuda", *args, "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return result, json.loads(out.read_text())


def test_a_cpu_only_torch_is_told_what_the_check_needs(tmp_path: Path) -> None:
    if cuda_build_missing() is None:
        pytest.skip("this torch is a CUDA build")
    command = [sys.executable, "-m", "lmforge", "plan", "--check-cuda", "@", "examples/pretrain/fake.toml"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "needs the CUDA build of torch" in result.stderr and "CPU-only" in result.stderr


def test_the_graph_walk_computes_the_engines_gradients() -> None:
    """The backward that the check runs in place of torch's engine gives the engine's gradients (real CPU
    tensors: a tiny Llama with lmforge's RMSNorm and RoPE functions and a document mask)."""
    from lmforge.model import build_model
    from lmforge.model.init import init_weights

    model = build_model(tiny_llama(), 256, "sdpa", torch.device("cpu"))
    init_weights(model, 0.02, 0, None, {})
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 48))
    doc_lens = torch.tensor([20, 28])
    positions = torch.cat([torch.arange(20), torch.arange(28)]).unsqueeze(0)

    def loss() -> torch.Tensor:
        return model(ids, positions, doc_lens, targets=ids.roll(-1)) / 48

    loss().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    failures: list[str] = []
    ran = run_graph_backward([loss()], [None], lambda node, e: failures.append(f"{node.name()}: {e}"))
    assert not failures
    assert ran["RMSNormFunctionBackward"] == 5 and ran["RotaryFunctionBackward"] == 4  # 2 blocks (2 + 2) + final
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def _example(name: str) -> Path:
    return ROOT / "examples" / "pretrain" / f"{name}.toml"


CASES = {
    "demo at 1 GPU": ("demo", 1, [], {"RMSNormFunction", "RotaryFunction"}),
    "llama-150m at 8, chunked loss, FP8": ("llama-150m", 8, ["--model.loss_chunk_tokens", "4096", "--model.fp8",
                                                              "tensorwise"], {"_FusedHeadCrossEntropy"}),
    "MoE, ep 2": ("moe", 2, ["--parallel.ep", "2"], {"_AllToAll"}),
    "MoE, cp 2, rowwise FP8": ("moe", 2, ["--parallel.cp", "2", "--model.fp8", "rowwise"], {"_GatherRow"}),
    "MoE, quantile rule, sequence-wise loss": ("moe", 1, ["--model.moe_balance.rule", "quantile",
                                                          "--model.moe_balance.seq_aux_coeff", "0.001"],
                                               {"_AuxLossGradient"}),
    "MoE research options, ep 2": ("moe", 2, ["--parallel.ep", "2", "--model.arch.attn_output_gate", "headwise",
                                              "--model.arch.xsa", "true", "--model.arch.null_experts", "2",
                                              "--model.arch.moe_latent_size", "64", "--model.arch.expert_glu",
                                              "situ_glu", "--model.arch.hyper_connections", "2"], {"_AllToAll"}),
    "Llama-3-8B at 64, cp 2": ("llama3-8b", 64, ["--parallel.cp", "2"], {"_GatherRow"}),
    "16B MoE at 16, ep 8": ("moe-16b", 16, [], {"_AllToAll"}),
    # tensor parallelism on CUDA meshes: local heads through the varlen kernel, torchao's float8 TP styles
    "llama-150m at 8, tp 2 x cp 2, FP8": ("llama-150m", 8, ["--parallel.tp", "2", "--parallel.cp", "2",
                                                            "--model.fp8", "tensorwise"],
                                          {"_GatherRow", "_FusedHeadCrossEntropy"}),
    "MoE, tp 2 x ep 2, research options, FP8": ("moe", 4, ["--parallel.tp", "2", "--parallel.ep", "2",
                                                           "--model.arch.hyper_connections", "2",
                                                           "--model.moe_balance.seq_aux_coeff", "0.001",
                                                           "--model.fp8", "tensorwise"],
                                                {"_AllToAll", "_AuxLossGradient"}),
    # sinks take flex attention, which compiles only on a GPU: the check stands in for its kernel, the rest runs
    "gpt-oss, tp 2 x cp 2": ("gpt-oss", 4, ["--parallel.tp", "2", "--parallel.cp", "2"],
                             {"_GatherRow", "_FusedKernelFootprint"}),
    # MLA's narrower values padded for the varlen kernel, through the CP gather (MTP, which does not run under CP,
    # off); experts over ep 2; and with the example's MTP module at ep 2
    "DeepSeek-V3, cp 2 x ep 2": ("deepseek-v3", 4, ["--parallel.cp", "2", "--parallel.ep", "2",
                                                    "--model.arch.num_nextn_predict_layers", "0"],
                                 {"_GatherRow", "_AllToAll"}),
    "DeepSeek-V3 with MTP, ep 2": ("deepseek-v3", 2, ["--parallel.ep", "2"], {"_AllToAll", "_AuxLossGradient"}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_examples_pass_the_check(tmp_path: Path, case: str) -> None:
    """Every example's CUDA step runs clean, lmforge's own backwards among the nodes run."""
    _needs_cuda_build()
    name, gpus, extra, functions = CASES[case]
    data = tomllib.loads(_example(name).read_text())["data"]
    result, check = _check(tmp_path, "@", str(_example(name)), "--gpus", str(gpus), *extra,
                           "--data.batch_tokens", str(data["micro_batch_tokens"] * gpus))  # fmt: skip
    assert result.returncode == 0 and check["ok"], result.stdout + result.stderr
    kernel = "flex" if name == "gpt-oss" else "varlen"
    assert check["choices"]["attention"].startswith(kernel) and check["choices"]["parameters"] == "bfloat16"
    assert check["backward_nodes"] > 100
    tp = extra[extra.index("--parallel.tp") + 1] if "--parallel.tp" in extra else "1"
    assert check["choices"]["tensor parallel"] == tp
    for function in functions | {"RMSNormFunction", "RotaryFunction"}:
        assert check["own_backwards"].get(f"{function}Backward", 0) > 0, (function, check["own_backwards"])
    assert "no problem found" in result.stdout


def _planted_line(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line and "_planted_line" not in line)


def _config(*args: str) -> object:
    config, _ = load_train_config(["@", str(_example("fake")), *args], 1)
    return config


def test_a_host_copy_planted_in_the_cuda_only_attention_branch_is_reported_with_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _needs_cuda_build()
    varlen = attention.varlen_attention

    def planted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: attention.DocumentMask,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        mask.cu_seqlens.cpu()  # planted: forward host copy
        return varlen(q, k, v, mask, window, sinks)

    monkeypatch.setitem(attention._FUNCTIONS, "varlen", planted)
    check = check_cuda(_config(), 1)  # type: ignore[arg-type]
    assert len(check.problems) == 1, check.problems
    problem = check.problems[0]
    assert problem.phase == "forward" and problem.module == "model.layers.0.self_attn", problem
    assert problem.where == f"{HERE}:{_planted_line('planted: forward host copy')} (planted)", problem
    assert "HostRead" in problem.error and "to the host" in problem.error


def test_a_host_copy_planted_in_a_custom_backward_is_reported_with_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_cuda_build()
    backward = RMSNormFunction.backward

    def planted(ctx: object, *grads: torch.Tensor) -> object:
        grads[0].cpu()  # planted: backward host copy
        return backward(ctx, *grads)

    monkeypatch.setattr(RMSNormFunction, "backward", staticmethod(planted))
    check = check_cuda(_config(), 1)  # type: ignore[arg-type]
    assert check.problems and all(p.node == "RMSNormFunctionBackward" for p in check.problems), check.problems
    where = f"{HERE}:{_planted_line('planted: backward host copy')} (planted)"
    assert {p.where for p in check.problems} == {where}
    # every norm of the 2 traced micro-batches: 2 per block and the final one, each named by its module
    assert sum(check.counts.values()) == 2 * (2 * 4 + 1)
    assert "model.layers.0.input_layernorm" in {p.module for p in check.problems}


def test_a_host_tensor_mixed_into_a_cuda_forward_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_cuda_build()
    varlen = attention.varlen_attention

    def planted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: attention.DocumentMask,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return varlen(q, k, v, mask, window, sinks) * torch.ones(q.shape[-1])  # planted: host tensor

    monkeypatch.setitem(attention._FUNCTIONS, "varlen", planted)
    check = check_cuda(_config(), 1)  # type: ignore[arg-type]
    assert [p.where for p in check.problems] == [f"{HERE}:{_planted_line('planted: host tensor')} (planted)"]
    assert "cpu" in check.problems[0].error and "cuda" in check.problems[0].error, check.problems[0].error
