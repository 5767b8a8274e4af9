"""`lmforge plan`: one step on fake tensors at a target world size (docs/plan.md)."""

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
from lmforge.plan.gpus import gpu_spec
from lmforge.plan.step import plan_step

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("parameters", "gradients", "optimizer state", "activations", "peak", "budget", "FLOPs per step",
           "compute time", "collective time", "step time", "tokens/s per GPU", "MFU")  # fmt: skip


def _plan(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "plan.json"
    env = {**os.environ, "COLUMNS": "200"}  # the tables' labels on one line each
    result = subprocess.run([sys.executable, "-m", "lmforge", "plan", *args, "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return result, json.loads(out.read_text())


def test_demo_at_one_gpu(tmp_path: Path) -> None:
    result, plan = _plan(tmp_path, "@", "examples/pretrain/demo.toml", "--gpus", "1")
    assert result.returncode == 0 and plan["fits"]
    for figure in FIGURES:
        assert figure in result.stdout, figure
    assert plan["world_size"] == 1 and plan["peak_bytes"] == pytest.approx(sum(plan["memory_bytes"].values()))
    assert plan["memory_bytes"]["parameters"] > 0 and plan["memory_bytes"]["activations"] > 0
    assert plan["choices"]["parameters"] == "bfloat16" and plan["choices"]["attention"].startswith("varlen")
    assert 0 < plan["mfu_estimate"] < 1 and plan["tokens_per_s_per_gpu_estimate"] > 0


@pytest.mark.parametrize("gpus", [8, 64])
def test_llama_150m_at_8_and_64_gpus(tmp_path: Path, gpus: int) -> None:
    # 64 GPUs take half the micro-batch: 524,288 tokens a step do not fill 64 micro-batches of 16,384
    extra = ["--data.micro_batch_tokens", "8192"] if gpus == 64 else []
    result, plan = _plan(tmp_path, "@", "examples/pretrain/llama-150m.toml", "--gpus", str(gpus), *extra)
    assert result.returncode == 0 and plan["fits"], result.stderr
    for figure in FIGURES:
        assert figure in result.stdout, figure
    comms = plan["collectives"]
    assert comms["all_gather"]["calls"] > 0 and comms["reduce_scatter"]["calls"] > 0
    # FSDP gathers each block's parameters in bf16: a rank receives (n - 1) / n of them per gather
    assert comms["all_gather"]["sent_bytes"] == pytest.approx(comms["all_gather"]["buffer_bytes"] * (gpus - 1) / gpus)
    # one node of 8 runs on NVLink; 8 nodes on the network, slower per byte
    per_byte = comms["all_gather"]["seconds"] / comms["all_gather"]["sent_bytes"]
    gpu = gpu_spec("h100")
    assert per_byte == pytest.approx(1 / (gpu.intra_node_bytes_s if gpus == 8 else gpu.inter_node_bytes_s))
    # torch's FLOP formulas on the traced matmuls agree with lmforge's 6 x N x tokens
    assert plan["traced_flops"] == pytest.approx(plan["flops_6nd_per_step"], rel=0.005)


@pytest.mark.slow  # tens of seconds: the quick tier keeps the small plans
def test_8b_at_one_gpu_does_not_fit(tmp_path: Path) -> None:
    result, plan = _plan(tmp_path, "@", "examples/pretrain/llama3-8b.toml", "--gpus", "1", "--model.ac.mode", "none",
                         "--vocab-size", "128256", "--no-suggest")  # fmt: skip
    assert result.returncode == 1 and not plan["fits"]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("lmforge plan: does not fit:") and "GiB over the" in line
    over = (plan["peak_bytes"] - plan["budget_bytes"]) / 2**30
    assert f"{over:.2f} GiB over" in line and over > 50  # fp32 weights, gradients and Adam alone are 120 GiB


@pytest.mark.slow  # tens of seconds: the quick tier keeps the small plans
def test_suggests_a_micro_batch_that_fits(tmp_path: Path) -> None:
    # a budget between the plans of 16,384 and 8,192 tokens a micro-batch (2 of the model's 12 layers: the search
    # plans up to 4 configs, and a plan's time grows with the layers)
    args = ["@", "examples/pretrain/llama-150m.toml", "--gpus", "8", "--vocab-size", "32000",
            "--model.arch.num_hidden_layers", "2"]  # fmt: skip
    _, full = _plan(tmp_path, *args)
    _, half = _plan(tmp_path, *args, "--data.micro_batch_tokens", "8192")
    budget = (full["peak_bytes"] + half["peak_bytes"]) / 2
    headroom = 1 - budget / full["gpu_memory_bytes"]
    result, plan = _plan(tmp_path, *args, "--headroom", f"{headroom:.6f}")
    assert result.returncode == 1 and not plan["fits"]
    assert any(s.startswith("--data.micro_batch_tokens 8192") for s in plan["suggestions"]), plan["suggestions"]
    assert "--data.micro_batch_tokens 8192" in result.stderr


def test_gpt_oss_plans_flex_attention_for_its_sinks_under_cp_and_ep(tmp_path: Path) -> None:
    result, plan = _plan(tmp_path, "@", "examples/pretrain/gpt-oss.toml", "--gpus", "8", "--parallel.cp", "2",
                         "--parallel.ep", "4", "--data.batch_tokens", "16384")  # fmt: skip
    assert result.returncode == 0, result.stderr
    # No varlen kernel computes sinks: the run takes flex attention, which the plan traces by its footprint.
    assert plan["choices"]["attention"].startswith("flex")
    assert any("flex attention has no backward on CPU" in note for note in plan["notes"])
    assert plan["flops_per_step"] > plan["flops_6nd_per_step"]  # the attention formula's share is in
    assert plan["collectives"]["all_to_all"]["calls"] > 0 and plan["collectives"]["all_gather"]["calls"] > 0


def test_moe_with_expert_parallelism_and_muon(tmp_path: Path) -> None:
    result, plan = _plan(tmp_path, "@", "examples/pretrain/moe.toml", "--gpus", "8", "--parallel.ep", "8",
                         "--data.batch_tokens", "16384")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert plan["collectives"]["all_to_all"]["calls"] > 0
    assert any("balanced routing" in note for note in plan["notes"])
    # only the experts a token uses: torch's formulas on the grouped matmuls agree with lmforge's active count;
    # Muon's Newton-Schulz matmuls are the update's, which MFU leaves out
    assert plan["traced_flops"] == pytest.approx(plan["flops_6nd_per_step"], rel=0.005)
    assert plan["optimizer_flops"] > 0


def test_tensor_parallelism_at_8_gpus(tmp_path: Path) -> None:
    args = ("@", "examples/pretrain/llama-150m.toml", "--gpus", "8")
    _, fsdp = _plan(tmp_path, *args)
    result, tp = _plan(tmp_path, *args, "--parallel.tp", "2")
    assert result.returncode == 0 and tp["fits"], result.stderr
    assert tp["choices"]["layout"].startswith("dp 4 x tp 2") and fsdp["choices"]["layout"] == "dp 8"
    # each GPU of a TP pair trains twice the rows of an FSDP rank, and holds half of each: the same share of tokens
    # and of FLOPs, torch's formulas on the rank's own (split) operators included
    assert tp["tokens_per_step"] == fsdp["tokens_per_step"]
    assert tp["flops_6nd_per_step"] == pytest.approx(fsdp["flops_6nd_per_step"], rel=1e-9)
    assert tp["flops_per_step"] == pytest.approx(fsdp["flops_per_step"], rel=0.01)  # other rows: other documents
    assert tp["traced_flops"] == pytest.approx(fsdp["traced_flops"], rel=0.02)
    # the optimizer state splits over the same 8 GPUs; the gathered (bf16) parameters are half as large in a TP pair
    assert tp["memory_bytes"]["optimizer state"] == pytest.approx(fsdp["memory_bytes"]["optimizer state"], rel=0.02)
    assert tp["memory_bytes"]["parameters"] < fsdp["memory_bytes"]["parameters"]
    # the TP pair's collectives, on NVLink, are their own kinds and add to the step instead of hiding behind it
    comms, gpu = tp["collectives"], gpu_spec("h100")
    inline = [kind for kind in comms if kind.endswith("(tp)")]
    assert {"all_gather (tp)", "reduce_scatter (tp)", "all_reduce (tp)"} <= set(inline)
    ag = comms["all_gather (tp)"]
    assert ag["seconds"] == pytest.approx(ag["sent_bytes"] / gpu.intra_node_bytes_s)
    assert tp["tensor_parallel_comm_seconds"] == pytest.approx(sum(comms[k]["seconds"] for k in inline))
    assert tp["step_seconds_estimate"] == pytest.approx(
        max(tp["compute_seconds"], tp["comm_seconds"] - tp["tensor_parallel_comm_seconds"])
        + tp["tensor_parallel_comm_seconds"]
    )
    assert "tensor-parallel (in line)" in result.stdout
    # tensorwise FP8 on CUDA: the TP pair all-gathers float8 tokens forward and float8 gradients backward, half
    # the bytes of bf16 (torchao's float8 tensors report the bf16 dtype; the plan counts their payload)
    result, fp8 = _plan(tmp_path, *args, "--parallel.tp", "2", "--model.fp8", "tensorwise")
    assert result.returncode == 0, result.stderr
    ratio = fp8["collectives"]["all_gather (tp)"]["sent_bytes"] / ag["sent_bytes"]
    assert ratio == pytest.approx(0.52, abs=0.02)  # the LM head's and the embedding's stay bf16


@pytest.mark.slow  # tens of seconds: the quick tier keeps the small plans
@pytest.mark.long  # a minute: CI plans 64 GPUs in test_llama_150m_at_8_and_64_gpus and cp in the gpt-oss case
def test_8b_at_64_gpus_with_context_parallelism(tmp_path: Path) -> None:
    result, plan = _plan(tmp_path, "@", "examples/pretrain/llama3-8b.toml", "--parallel.cp", "2",
                         "--vocab-size", "128256")  # fmt: skip
    assert result.returncode == 0 and plan["world_size"] == 64, result.stderr
    assert plan["tokens_per_step"] == 16 * 8192 // 2  # 16 micro-batches, each rank holding half of every row


@pytest.mark.parametrize(("dtype", "ac"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "selective")])
def test_planned_memory_equals_a_real_cpu_step(dtype: str, ac: str) -> None:
    """The same tracker over the same step on the CPU: fake tensors predict what real ones use (float32: the model
    FSDP does not wrap; bfloat16: FSDP's mixed precision)."""
    config, _ = load_train_config(["@", str(ROOT / "examples/pretrain/fake.toml"), "--model.param_dtype", dtype,
                                   "--model.ac.mode", ac], 1)  # fmt: skip
    cpu, gpu = torch.device("cpu"), gpu_spec("h100")
    planned = plan_step(config, 1, gpu, 8, target=cpu)
    real = plan_step(config, 1, gpu, 8, target=cpu, fake=False)  # after the fake step: it must leave nothing fake
    assert real.memory["activations"] > 0 and real.memory["optimizer state"] > 0
    assert planned.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)  # within 1% (asked: 5%)
    for category in ("parameters", "gradients", "optimizer state"):
        assert planned.memory[category] == real.memory[category]


def test_a_multi_node_step_bound_by_its_collectives_is_told_what_hybrid_sharding_changes(tmp_path: Path) -> None:
    args = ("@", "examples/pretrain/llama-150m.toml", "--gpus", "16", "--gpus-per-node", "4",
            "--data.micro_batch_tokens", "2048")  # fmt: skip
    result, plan = _plan(tmp_path, *args)
    assert plan["comm_seconds"] > plan["compute_seconds"]  # 4 nodes, 8 micro-batches, every all-gather across nodes
    hint = plan["hybrid_sharding_hint"]
    assert "--parallel.dp_replicate 4" in hint and "hint: communication-bound" in result.stdout
    # the hint is the plan of that layout
    _, hybrid = _plan(tmp_path, *args, "--parallel.dp_replicate", "4")
    assert hybrid["comm_seconds"] < plan["comm_seconds"] and "hybrid_sharding_hint" not in hybrid
    assert f"at {hybrid['comm_seconds']:.2f} s of collectives" in hint
    assert f"{hybrid['peak_bytes'] / 2**30:.1f} GiB per GPU (fits)" in hint


def _fake_at_two() -> object:
    config, _ = load_train_config(["@", str(ROOT / "examples/pretrain/fake.toml")], 2)
    return config


def test_a_torch_without_the_memory_trackers_plans_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's memory trackers are private: where a torch lacks them, the plan says so and gives every other figure."""
    from io import StringIO

    import torch.distributed._tools.fake_collectives  # noqa: F401 - the package itself imports a tracker
    from rich.console import Console

    from lmforge.plan.report import PlanReport, render
    from lmforge.plan.step import MEMORY_TRACKERS

    for module in MEMORY_TRACKERS:
        monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    gpu = gpu_spec("h100")
    plan = plan_step(_fake_at_two(), 2, gpu, 8)  # type: ignore[arg-type]
    assert plan.memory == {} and plan.flops > 0 and plan.compute_seconds > 0
    assert plan.comms["all_gather"].calls > 0 and plan.comms["reduce_scatter"].calls > 0
    assert any(n.startswith("memory not given") and "fsdp2_mem_tracker" in n for n in plan.notes), plan.notes
    report = PlanReport(plan, gpu, 2, 8, 0.1)
    assert report.fits and not report.memory_known and report.to_json()["memory_known"] is False
    out = StringIO()
    render(report, Console(file=out, width=200))
    assert "not given by this torch" in out.getvalue() and "MFU" in out.getvalue()


def test_a_torch_without_fake_collectives_plans_without_collective_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.fake_collectives", None)
    plan = plan_step(_fake_at_two(), 2, gpu_spec("h100"), 8)  # type: ignore[arg-type]
    assert plan.comms == {} and plan.comm_seconds == 0
    assert any("collectives whose size this torch's fake_collectives cannot give" in n for n in plan.notes)
    assert plan.peak_bytes > 0 and plan.flops > 0


def test_a_torch_without_a_fake_process_group_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    with pytest.raises(ValueError, match="no fake process group"):
        plan_step(_fake_at_two(), 2, gpu_spec("h100"), 8)  # type: ignore[arg-type]


def test_bad_flags_are_named(tmp_path: Path) -> None:
    for args, message in ((["--gpu", "v100"], "unknown --gpu 'v100'"), (["--gpus", "x"], "--gpus 'x' is not"),
                          (["--gpus", "3"], "not a multiple of data.micro_batch_tokens x world size")):  # fmt: skip
        result = subprocess.run([sys.executable, "-m", "lmforge", "plan", "@", "examples/pretrain/demo.toml", *args],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_slurm_dry_run_shows_the_plan(tmp_path: Path) -> None:
    gpu_job = tmp_path / "gpus.toml"
    gpu_job.write_text("[deployment]\nprocs_per_node = 8\n\n[slurm]\ngpus_per_node = 8\n")
    result = subprocess.run([sys.executable, "-m", "lmforge", "slurm", "@", "examples/pretrain/llama-150m.toml", "@",
                             str(gpu_job), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan, script = result.stdout.split("#!", 1)
    assert "plan: 8 x h100 (1 node of 8)" in plan and "planned in" in plan and "fits" in plan
    assert "#SBATCH --gpus-per-node=8" in script


EXAMPLES = ("demo", "fake", "llama-150m", "moe", "llama3-8b", "moe-16b", "sft")


def _divisible_batch(example: Path, gpus: int) -> list[str]:
    """`--data.batch_tokens` rounded up to a multiple of micro_batch_tokens x data-parallel ranks, when needed."""
    data = tomllib.loads(example.read_text())["data"]
    parallel = tomllib.loads(example.read_text()).get("parallel", {})
    ranks = max(1, gpus // parallel.get("cp", 1))
    step = data["micro_batch_tokens"] * ranks
    batch = -(-data["batch_tokens"] // step) * step
    return [] if batch == data["batch_tokens"] else ["--data.batch_tokens", str(batch)]


@pytest.mark.slow  # 21 plans, about 6 minutes; CI plans at 8 GPUs (one GPU: test_demo_at_one_gpu and the 8B's cases)
@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.long), 8, pytest.param(64, marks=pytest.mark.long)])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n == "moe-16b" else n for n in EXAMPLES])
def test_every_example_plans(tmp_path: Path, name: str, gpus: int) -> None:
    """Every example config plans at 1, 8 and 64 GPUs: it fits (exit 0) or says by how much it does not (exit 1)."""
    example = ROOT / "examples" / ("sft/shakespeare.toml" if name == "sft" else f"pretrain/{name}.toml")
    extra = _divisible_batch(example, gpus)
    ep = tomllib.loads(example.read_text()).get("parallel", {}).get("ep", 1)
    if gpus % ep:
        extra += ["--parallel.ep", "1"]
    elif gpus == ep > 1:  # selective checkpointing does not run when each rank's experts are unsharded
        extra += ["--model.ac.mode", "full"]
    if name == "sft":  # a pretrained folder's config and tokenizer stand in for the demo's model
        from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

        folder = tmp_path / "model"
        save_tokenizer_folder(train_bpe([f"to be or not to be, {i}" for i in range(100)], vocab_size=300), folder)
        arch = {"model_type": "llama", "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256, "vocab_size": 384,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(arch))
        extra += ["--model.name", str(folder)]
    result, plan = _plan(tmp_path, "@", str(example), "--gpus", str(gpus), "--no-suggest", *extra)
    assert plan["world_size"] == gpus and plan["peak_bytes"] > 0 and plan["flops_per_step"] > 0
    assert "planned in" in result.stdout and "MFU" in result.stdout
    if not plan["fits"]:
        assert "GiB over the" in result.stderr
    if gpus > 1:
        assert plan["collectives"]["all_gather"]["calls"] > 0
