"""Tensor parallelism's parts: the config checks name each field a bad `parallel.tp` breaks; a model split over 2
ranks (gloo) gives the unsplit model's loss, gradients, per-position losses and logits, with the vocabulary-split
embedding and loss, chunked and not, for Llama and for Qwen3 (QK-norm); Muon's step on TP-split matrices is the
unsplit one; an MoE with shared experts, hyper-connections and the sequence-wise balance loss, and emulated float8
layers under both recipes, give the unsplit model's loss and gradients; a vocabulary that does not split is
refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from lmforge.config import ConfigError, load_train_config
from tests.conftest import arch_toml, tiny_llama, tiny_qwen3
from tests.integration.runner import TINY_ARCH, write_config
from tests.spawn import free_port, join_as_rank, run_ranks
from tests.unit.test_moe import tiny_deepseek, tiny_glm, tiny_gpt_oss


def _problems(tmp_path: Path, world: int, *flags: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_train_config(["@", str(write_config(tmp_path, "bad")), *flags], world)
    return str(err.value)


def test_each_bad_tp_names_its_field(tmp_path: Path) -> None:
    # the tiny Llama: 4 heads, 2 KV heads, intermediate 128; rows of 128 tokens, sequences of 64
    msg = _problems(tmp_path, 3, "--parallel.tp", "3")
    for field in ("model.arch.num_attention_heads", "model.arch.num_key_value_heads", "model.arch.intermediate_size",
                  "data.seq_len", "data.micro_batch_tokens"):  # fmt: skip
        assert field in msg and "parallel.tp = 3" in msg, (field, msg)
    msg = _problems(tmp_path, 16, "--parallel.tp", "4", "--parallel.cp", "4", "--data.seq-len", "16")
    assert "data.seq_len" in msg and "16 does not split into 32 equal parts (parallel.tp = 4 x 2 x parallel.cp" in msg
    assert "model.arch.num_key_value_heads" in msg and "2 does not divide by parallel.tp = 4" in msg
    assert "data.micro_batch_tokens" not in msg and "parallel.tp (" not in msg  # 128 splits; 16 ranks hold the grid
    assert "parallel.tp" in _problems(tmp_path, 6, "--parallel.tp", "2", "--parallel.cp", "2")  # 4 does not divide 6
    msg = _problems(tmp_path, 4, "--parallel.tp", "2", "--val.micro-batch-tokens", "63")
    assert "val.micro_batch_tokens" in msg
    # an MoE's shared experts split like a dense MLP; a latent MoE's projections would take per-rank float8 scales
    moe = arch_toml(tiny_glm(n_shared_experts=1, moe_intermediate_size=18, moe_latent_size=32))
    moe_config = write_config(tmp_path, "moe")
    moe_config.write_text(moe_config.read_text().replace(TINY_ARCH, moe))
    with pytest.raises(ConfigError) as err:
        load_train_config(["@", str(moe_config), "--parallel.tp", "4", "--model.fp8", "rowwise"], 4)
    msg = str(err.value)
    assert "model.arch.moe_intermediate_size" in msg and "shared experts' width 1 x 18 does not divide" in msg
    assert "model.fp8" in msg and "latent MoE" in msg
    # MLA's latent projections have no TP split yet: refused by name
    mla_config = write_config(tmp_path, "mla")
    mla_config.write_text(mla_config.read_text().replace(TINY_ARCH, arch_toml(tiny_deepseek())))
    with pytest.raises(ConfigError, match=r"parallel.tp .*'deepseek_v3' \(multi-head latent attention\) does not"):
        load_train_config(["@", str(mla_config), "--parallel.tp", "2"], 2)
    good = ("--parallel.tp", "2", "--model.fp8", "tensorwise", "--model.moe_balance.seq_aux_coeff", "0.001")
    load_train_config(["@", str(write_config(tmp_path, "good")), *good], 4)  # a good layout passes


def _split_model_worker(rank: int, port: int, tmp: str) -> None:
    join_as_rank(rank, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lmforge.model import build_model
    from lmforge.model.fp8 import apply_fp8
    from lmforge.model.init import init_weights
    from lmforge.optim.muon import Muon
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed
    from lmforge.parallel.tensor import TensorShard, apply_tensor_parallel

    init_distributed(timeout_minutes=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(ConfigError, match=r"parallel\.tp = 2 does not divide the model's vocabulary of 255 token ids"):
        apply_tensor_parallel(build_model(tiny_llama(), 255, "sdpa", torch.device("cpu")), TensorShard(mesh, rank, 2))
    found: dict[str, float] = {}
    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 256, (1, 64), generator=gen), torch.randint(0, 256, (1, 64), generator=gen)
    targets[0, :5] = -100
    doc_lens = torch.tensor([20, 30, 14])
    pos = torch.cat([torch.arange(int(n)) for n in doc_lens]).unsqueeze(0)

    def compare(key: str, whole: torch.nn.Module, split: torch.nn.Module) -> None:
        want, got = whole(ids, pos, doc_lens, targets=targets), split(ids, pos, doc_lens, targets=targets)
        found[f"{key}/loss"] = abs(got.item() - want.item()) / want.item()
        want.backward()
        got.backward()
        reference = dict(whole.named_parameters())
        worst = 0.0
        for name, p in split.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            worst = max(worst, ((g - reference[name].grad).abs().max() / reference[name].grad.abs().max()).item())
        found[f"{key}/grads"] = worst

    for arch_name, arch in (("llama", tiny_llama()), ("qwen3", tiny_qwen3())):
        for chunk in (0, 24):
            whole = build_model(arch, 256, "sdpa", torch.device("cpu"))
            init_weights(whole, 0.02, 1)
            whole.loss_chunk_tokens = chunk
            split = copy.deepcopy(whole)
            apply_tensor_parallel(split, TensorShard(mesh, rank, 2))
            key = f"{arch_name}/{chunk}"
            compare(key, whole, split)
            with torch.no_grad():
                per_token = split(ids, pos, doc_lens, targets=targets, per_token=True)
                per_token -= whole(ids, pos, doc_lens, targets=targets, per_token=True)
                found[f"{key}/per_token"] = per_token.abs().max().item()
                found[f"{key}/logits"] = (split(ids, pos, doc_lens) - whole(ids, pos, doc_lens)).abs().max().item()
            if chunk == 0:
                # one Muon step on the blocks' matrices, split (column- and row-wise) and whole
                steps = []
                for model in (whole, split):
                    mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "layers" in n]
                    Muon(mats, lr=0.1).step()
                    steps.append({n: p for n, p in model.named_parameters() if p.ndim == 2 and "layers" in n})
                found[f"{key}/muon"] = max(
                    (steps[1][n].full_tensor() - p).abs().max().item() for n, p in steps[0].items()
                )
    # An MoE (shared experts split, router and routed experts on each rank's tokens) with hyper-connections (the
    # stream's tokens split) and the sequence-wise balance loss (choices summed over the pair); emulated float8
    # layers of either recipe, on Llama and on the MoE with a per-head output gate too narrow for float8.
    options = {
        "moe-hc-seq_aux": (tiny_glm(hyper_connections=2), "none"),
        "fp8-tensorwise": (tiny_llama(), "tensorwise"),
        "fp8-rowwise": (tiny_llama(), "rowwise"),
        "moe-fp8-tensorwise": (tiny_glm(attn_output_gate="headwise"), "tensorwise"),
        # sinks split with the heads, sliding windows, biased router and experts on each rank's tokens
        "gpt-oss": (tiny_gpt_oss(), "none"),
    }
    for key, (arch, fp8) in options.items():
        whole = build_model(arch, 256, "sdpa", torch.device("cpu"))
        init_weights(whole, 0.02, 1)
        if fp8 != "none":
            assert apply_fp8(whole.blocks, fp8, emulate=True, fsdp_all_gather=False)
        for block in whole.moe_layers().values():
            block.seq_aux = True
            block.aux_scale.fill_(0.5)
        split = copy.deepcopy(whole)
        apply_tensor_parallel(split, TensorShard(mesh, rank, 2))
        compare(key, whole, split)
        if key == "moe-hc-seq_aux":
            sums = torch.stack([b.seq_aux_sum for b in split.moe_layers().values()])
            torch.distributed.all_reduce(sums)  # each rank holds its tokens' part of the loss
            want = torch.stack([b.seq_aux_sum for b in whole.moe_layers().values()])
            found[f"{key}/seq_aux"] = ((sums - want).abs().max() / want.abs().max()).item()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(found))
    shutdown_distributed()


@pytest.mark.slow
def test_a_split_model_computes_what_the_whole_one_does(tmp_path: Path) -> None:
    for found in run_ranks(_split_model_worker, (free_port(), str(tmp_path)), tmp_path, timeout=240):
        assert len(found) == 29
        for key, err in found.items():
            tolerance = 1e-5 if key.endswith(("loss", "grads", "seq_aux")) else 1e-6
            if key == "moe-hc-seq_aux/grads":
                # The hyper-connections' static weights get gradients about 1/300 of the largest ones, sums over
                # every token that largely cancel: fp32 rounding leaves up to ~7e-5 of their size (2e-7 absolute).
                # In float64 the whole model matches within 5e-8.
                tolerance = 2e-4
            assert err < tolerance, (key, err)
