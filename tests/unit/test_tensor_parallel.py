"""Tensor parallelism's parts: the config checks name each field a bad `parallel.tp` breaks; a model split over 2
ranks (gloo) gives the unsplit model's loss, gradients, per-position losses and logits, with the vocabulary-split
embedding and loss, chunked and not, for Llama and for Qwen3 (QK-norm); Muon's step on TP-split matrices is the
unsplit one; a vocabulary that does not split is refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from lmforge.config import ConfigError, load_train_config
from tests.conftest import tiny_llama, tiny_qwen3
from tests.integration.runner import write_config
from tests.spawn import free_port, join_as_rank, run_ranks


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
    msg = _problems(tmp_path, 4, "--parallel.tp", "2", "--model.fp8", "tensorwise")
    assert "model.fp8" in msg and "not supported with parallel.tp > 1 yet" in msg
    msg = _problems(tmp_path, 4, "--parallel.tp", "2", "--model.moe_balance.seq_aux_coeff", "0.001")
    assert "model.moe_balance.seq_aux_coeff" in msg and "parallel.tp > 1" in msg
    load_train_config(["@", str(write_config(tmp_path, "good")), "--parallel.tp", "2"], 4)  # a good layout passes


def _split_model_worker(rank: int, port: int, tmp: str) -> None:
    join_as_rank(rank, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lmforge.model import build_model
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
    for arch_name, arch in (("llama", tiny_llama()), ("qwen3", tiny_qwen3())):
        for chunk in (0, 24):
            whole = build_model(arch, 256, "sdpa", torch.device("cpu"))
            init_weights(whole, 0.02, 1)
            whole.loss_chunk_tokens = chunk
            split = copy.deepcopy(whole)
            apply_tensor_parallel(split, TensorShard(mesh, rank, 2))
            key = f"{arch_name}/{chunk}"
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
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(found))
    shutdown_distributed()


@pytest.mark.slow
def test_a_split_model_computes_what_the_whole_one_does(tmp_path: Path) -> None:
    for found in run_ranks(_split_model_worker, (free_port(), str(tmp_path)), tmp_path, timeout=240):
        assert len(found) == 18
        for key, err in found.items():
            assert err < (1e-5 if key.endswith(("loss", "grads")) else 1e-6), (key, err)
