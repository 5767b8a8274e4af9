"""Nothing in a training step, or in a validation round's scoring loops, waits on the host, except the step's one
read-back of its reduction.

`tests.host_sync.HostSyncDetector` records every op that would read a device value on the host on CUDA. These tests
run whole `train_step`s under it, from the first micro-batch to the end of the optimizer update (dense with Muon
and AdamW, MoE with grouped experts and the sign or quantile balancing rule, the research options, chunked loss,
activation checkpointing, emulated FP8, SFT; on two processes FSDP with sharded Muon, deferred gradient sync,
context parallelism, hybrid sharding and expert parallelism), and one validation round (token sets, ppl, ctxcont
and pairs sets, held-out SFT samples), and fail naming the line of any read. The reads that must stay are named below
(`REDUCTION_READ`, `LOOP_READ`, `EP_READ`) and listed in docs/gpu.md with their reasons.
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lmforge.eval.scoring as scoring
import lmforge.train.micro_batches as micro_batches
from lmforge.config import TrainConfig
from lmforge.data.batch import MicroBatch
from lmforge.eval.validation import Validator
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.moe import Experts
from lmforge.parallel.process_group import DistContext, init_distributed, mesh_degrees
from lmforge.train.callbacks.validation import Validation
from lmforge.train.trainer import Trainer
from tests.chat import chat_tokenizer, conversation, write_jsonl
from tests.conftest import LONG, require, tiny_llama, tiny_qwen3
from tests.host_sync import HostSyncDetector, checked
from tests.shards import random_docs, word_tokenizer, write_shard
from tests.spawn import free_port, join_as_rank, run_ranks
from tests.unit.test_micro_batches import make_batches
from tests.unit.test_moe import tiny_deepseek, tiny_glm, tiny_gpt_oss

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def test_an_injected_item_and_mask_index_are_caught_with_their_lines(
    ctx: DistContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(tiny_llama(), 128, "sdpa", CPU)
    init_weights(model, 0.02, 0)
    lines = {}
    plain = micro_batches.token_loss_sum

    def leaky_loss(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        loss = plain(model, mb)
        lines["item"] = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        loss.item()
        lines["mask"] = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        _ = mb.target_ids[mb.loss_mask]
        mb.doc_lens.tolist()  # doc_lens stays on the host: reading it is free
        mb.loss_mask.sum().tolist()
        return loss

    monkeypatch.setattr(micro_batches, "token_loss_sum", leaky_loss)
    detector = HostSyncDetector()
    detector.watch_module(model)
    with detector:
        micro_batches.run_micro_batches(model, make_batches(2), CPU)
    here = Path(__file__).relative_to(Path(__file__).parents[2])
    found = [(e.op, e.where) for e in detector.events]
    expected = [
        ("aten._local_scalar_dense.default", f"{here}:{lines['item']}"),
        ("aten.index.Tensor", f"{here}:{lines['mask']}"),
        ("Tensor.tolist", f"{here}:{lines['mask'] + 2}"),
    ]
    assert found == expected * 2
    assert f"{here}:{lines['item']}" in detector.report()


def test_an_item_planted_in_the_optimizer_update_is_caught(
    ctx: DistContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Trainer(_config(tmp_path), ctx, console=False)
    update = type(trainer.optimizer).update
    line = {}

    def leaky_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = next(p for g in self.param_groups for p in g["params"] if p.grad is not None)
        line["item"] = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        first.grad.abs().max().item()  # e.g. a gradient check someone adds
        return update(self, *args, **kwargs)

    monkeypatch.setattr(type(trainer.optimizer), "update", leaky_update)
    detector, _ = run_checked(trainer, monkeypatch)
    here = Path(__file__).relative_to(Path(__file__).parents[2])
    planted = [e for e in detector.events if e.where == f"{here}:{line['item']}"]
    assert [e.op for e in planted] == ["aten._local_scalar_dense.default"] * 2, detector.report()
    assert not expected_reads("dense", reads(detector))


def test_uploads_and_device_factories_are_device_tensors_and_host_copies_stay_host(ctx: DistContext) -> None:
    detector = HostSyncDetector()
    host = torch.arange(6)
    with detector:
        on_device = host.to(CPU)
        host.sum().item()  # a host tensor: free
        assert not detector.events
        assert on_device is not host and detector.is_device(on_device) and not detector.is_device(host)
        (on_device * 2)[0].item()
        made = torch.zeros(3, device=CPU)
        bool(made.any())
        torch.zeros(3, device="cpu").sum().item()  # the string "cpu" names the host
        nz = on_device.nonzero()
        counts = torch.ones(2, dtype=torch.long, device=CPU)
        torch.repeat_interleave(counts)
        torch.repeat_interleave(counts, output_size=2)  # sized: no read
        on_device.cpu()
    assert [e.op for e in detector.events] == [
        "aten._local_scalar_dense.default",
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.repeat_interleave.Tensor",
        "Tensor.cpu",
    ]
    assert detector.is_device(nz)


def _config(tmp: Path, **overrides: Any) -> TrainConfig:
    raw: dict[str, Any] = {
        "max_steps": 2,
        "output_dir": str(tmp / "run"),
        "model": {"arch": tiny_llama().model_dump()},
        "data": {
            "type": "fake",
            "seq_len": 32,
            "batch_tokens": 256,
            "micro_batch_tokens": 64,
            "vocab_size": 100,
            "mean_doc_len": 12.0,
        },
        "optim": {"lr": 1e-3},
        "schedule": {"warmup": 0.0, "decay": 0.0},
    }
    for key, value in overrides.items():
        merge = isinstance(raw.get(key), dict) and "type" not in value  # a new data type replaces the section
        raw[key] = {**raw[key], **value} if merge else value
    return TrainConfig.model_validate(raw)


def _val_files(tmp: Path) -> dict[str, Any]:
    """A word tokenizer, a held-out token folder and ppl / ctxcont / pairs set files: `[val]` and `[tokenizer]`."""
    tok = word_tokenizer(tmp / "tok", size=100)
    write_shard(tmp / "held", "00000", random_docs(20, seed=5, vocab=100))
    sets, rng = tmp / "sets", np.random.default_rng(0)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(1, 99, size=n))  # noqa: E731
    write_jsonl(sets / "words.ppl.jsonl", [{"text": words(int(n))} for n in rng.integers(3, 40, size=6)])
    quiz = [
        {"context": words(5), "continuations": [" " + words(2) for _ in range(3)], "label": i % 3} for i in range(5)
    ]
    write_jsonl(sets / "quiz.ctxcont.jsonl", quiz)
    write_jsonl(sets / "minimal.pairs.jsonl", [{"good": words(4), "bad": words(4)} for _ in range(4)])
    # the same files scored by lm-evaluation-harness's rules (rolling windows, its tokenization)
    for name in ("words.ppl", "quiz.ctxcont"):
        shutil.copy(sets / f"{name}.jsonl", sets / f"{name.replace('.', '_h.')}.jsonl")
    lmeval = [{"name": "words_h", "convention": "lmeval"}, {"name": "quiz_h", "convention": "lmeval"}]
    return {
        "tokenizer": {"name": str(tok)},
        "val": {
            "sets": [{"name": "held", "path": str(tmp / "held")}, "words", "quiz", "minimal", *lmeval],
            "data_dir": str(sets),
            "seq_lens": [16, 64],
            "micro_batch_tokens": 64,
        },
    }


def _sft_files(tmp: Path) -> dict[str, Any]:
    """A chat tokenizer, SFT training and held-out files: `[data]`, `[val]` and `[tokenizer]` of an SFT run."""
    tok = chat_tokenizer(tmp / "chat_tok")
    rows = [{"messages": conversation(i, turns=1 + i % 2, system=i % 3 == 0)} for i in range(24)]
    write_jsonl(tmp / "chat" / "train.jsonl", rows[:16])
    write_jsonl(tmp / "chat" / "val.jsonl", rows[16:])
    return {
        "tokenizer": {"name": str(tok)},
        "data": {
            "type": "sft",
            "paths": [str(tmp / "chat" / "train.jsonl")],
            "seq_len": 64,
            "batch_tokens": 256,
            "micro_batch_tokens": 128,
            "max_epochs": 20,
        },
        "val": {"data": str(tmp / "chat" / "val.jsonl")},
    }


CASES: dict[str, Any] = {
    "dense": lambda tmp: {},
    "chunked-loss": lambda tmp: {"model": {"arch": tiny_llama().model_dump(), "loss_chunk_tokens": 16}},
    "selective-ac": lambda tmp: {"model": {"arch": tiny_llama().model_dump(), "ac": {"mode": "selective"}}},
    "full-ac": lambda tmp: {"model": {"arch": tiny_llama().model_dump(), "ac": {"mode": "full"}}},
    "moe-grouped": lambda tmp: {"model": {"arch": tiny_glm().model_dump(), "moe_balance": {"seq_aux_coeff": 1e-3}}},
    "moe-loop": lambda tmp: {"model": {"arch": tiny_glm().model_dump()}},
    "moe-expert-groups": lambda tmp: {"model": {"arch": tiny_glm(n_group=4, topk_group=2).model_dump()}},
    # sinks, sliding windows, YaRN, biased router and experts with the clamped SwiGLU
    "gpt-oss": lambda tmp: {"model": {"arch": tiny_gpt_oss().model_dump()}},
    # MLA with a low-rank query path, interleaved RoPE and YaRN's mscale; group-limited routing
    "deepseek-v3": lambda tmp: {"model": {"arch": tiny_deepseek(q_lora_rank=24).model_dump()}},
    "deepseek-v3-mtp": lambda tmp: {"model": {"arch": tiny_deepseek(num_nextn_predict_layers=2).model_dump()}},
    "moe-research-options": lambda tmp: {
        "model": {
            "arch": tiny_glm(
                null_experts=2, xsa=True, attn_output_gate="headwise", moe_latent_size=16, expert_glu="situ_glu"
            ).model_dump()
        }
    },
    "moe-quantile": lambda tmp: {
        "model": {"arch": tiny_glm(router_bias_on_logits=True).model_dump(), "moe_balance": {"rule": "quantile"}}
    },
    "adamw": lambda tmp: {"optim": {"type": "adamw", "lr": 1e-3}},
    "windows-yarn": lambda tmp: {
        "model": {
            "arch": tiny_qwen3(
                use_sliding_window=True,
                sliding_window=4,
                layer_types=("sliding_attention", "full_attention"),
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            ).model_dump()
        }
    },
    "fp8-emulated": lambda tmp: {
        "model": {"arch": tiny_llama().model_dump(), "fp8": "tensorwise", "fp8_emulate": True}
    },
    "validation": _val_files,
    "sft": _sft_files,
}


REDUCTION_READ = "Tensor.cpu at src/lmforge/train/metrics.py"
"""The step's one read: the values of its SUM and MAX all-reduce, on the host once (`reduce_step_stats`)."""

MUON_TABLE_READ = "Tensor.tolist at src/lmforge/optim/muon_sharded.py"
"""Sharded Muon's row table: read at a run's first step only (one all_gather per process group), kept after."""

LOOP_READ = "Tensor.tolist at src/lmforge/model/moe.py"
"""The one host read the checks expect: the per-expert `loop` reference reads the expert sizes (see `Experts`)."""

EP_READ = "Tensor.tolist at src/lmforge/parallel/experts.py"
"""The expert-parallel dispatch's one host read: the exchange sizes `all_to_all_single` takes as host ints."""


PP_WARMUP_READ = "aten._local_scalar_dense.default at src/lmforge/parallel/pipeline.py"
"""torch's pipelining reads one value per stage at a schedule's first step (`_warmup_p2p`: the vote whose
`result.item()` picks static or inferred shapes), inside `Pipeline.step`; never again after."""


def build(config: TrainConfig, ctx: DistContext, case: str) -> Trainer:
    """The case's trainer; `moe-loop` runs its experts through the per-expert loop (a known host read, which shows
    that the detector sees inside the model as the trainer runs it)."""
    trainer = Trainer(config, ctx, console=False)
    if case.startswith("moe-loop"):
        for module in trainer.model.modules():
            if isinstance(module, Experts):
                module.impl = "loop"
    return trainer


def reads(detector: HostSyncDetector) -> list[str]:
    """The recorded host reads as `op at file:line`."""
    return [f"{e.op} at {e.where}" for e in detector.events]


def expected_reads(case: str, found: list[str], steps: int = 2) -> bool:
    """The reduction's one read per step, and nothing else; for `moe-loop` also the loop's own (at least one per MoE
    layer and micro-batch)."""
    reduction = [f for f in found if f.startswith(REDUCTION_READ)]
    rest = [f for f in found if not f.startswith(REDUCTION_READ)]
    if len(reduction) != steps:
        return False
    if case.startswith("pp2"):  # the schedule's one-time warm-up: one read per stage held, in the first step only
        warmup = [f for f in rest if f.startswith(PP_WARMUP_READ)]
        return len(warmup) == (2 if "zbv" in case else 1) and len(rest) == len(warmup)
    if not case.startswith("moe-loop"):
        return not rest
    return len(rest) >= 8 and all(f.startswith(LOOP_READ) for f in rest)


def watch(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> HostSyncDetector:
    """A detector over the trainer's model, put around whole training steps and the validation scoring loops."""
    detector = HostSyncDetector()
    detector.watch_module(trainer.model)
    monkeypatch.setattr(Trainer, "train_step", checked(detector, Trainer.train_step))
    monkeypatch.setattr(Validator, "token_sums", checked(detector, Validator.token_sums))
    monkeypatch.setattr(scoring, "request_loglik_sums", checked(detector, scoring.request_loglik_sums))
    return detector


def run_checked(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> tuple[HostSyncDetector, list[str]]:
    """Two steps, then a validation round where the run has one; the detector and the metric names seen. The
    first step's reads of sharded Muon's row table (`MUON_TABLE_READ`) are taken out: the later steps show that the
    table is not read again."""
    detector = watch(trainer, monkeypatch)
    names: list[str] = []
    try:
        for cb in trainer.callbacks:
            cb.on_train_start(trainer)  # as `Trainer.train` starts: outside the steps
        for step in range(2):
            names += trainer.train_step(trainer.data.next_step(), 0.0)
            if step == 0:
                detector.events = [e for e in detector.events if not f"{e.op} at {e.where}".startswith(MUON_TABLE_READ)]
        for cb in trainer.callbacks:
            if isinstance(cb, Validation):
                names += cb.validator.evaluate(trainer.scorer, trainer.ctx.device)
    finally:
        detector.close()
        trainer.close()
    return detector, names


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_steps_and_validation_never_read_the_device(
    ctx: DistContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None, case: str
) -> None:
    if case.startswith("fp8"):
        require("torchao.float8")
    trainer = build(_config(tmp_path, **CASES[case](tmp_path)), ctx, case)
    detector, names = run_checked(trainer, monkeypatch)
    assert expected_reads(case, reads(detector)), detector.report()
    # The checked loops did run: the step's loss, and each case's own metrics.
    assert "loss/mean" in names
    if case == "validation":
        assert {"val/held/loss@16", "val/words/bpb@64", "val/quiz/acc_norm@64", "val/minimal/acc@16"} <= set(names)
        assert {"val/words_h/word_perplexity@64", "val/quiz_h/acc_bytes@16"} <= set(names)
    if case == "sft":
        assert "val/loss" in names
    if case == "moe-grouped":
        assert any(n.startswith("moe/") for n in names)
    if case == "moe-research-options":
        assert "moe/null_share" in names
    if case == "moe-quantile":
        assert "moe/quantile/edge_share" in names


LONG_CASES = frozenset({"dense-deferred", "moe-loop", "moe-quantile-cp2", "pp2"})
"""Two-process cases that only long mode runs, each beside one CI runs: deferred sync with an MoE, the grouped MoE
kernel, the quantile rule on one process with cp 2 on a dense model, and pipelines under zbv and with an MoE."""


def _two_rank_worker(rank: int, port: int, tmp: str) -> None:
    join_as_rank(rank, port)
    from lmforge.parallel.process_group import shutdown_distributed

    init_distributed(timeout_minutes=2)
    found: dict[str, list[str]] = {}
    tmp_path = Path(tmp)
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Expert parallelism: exactly one host read per MoE block forward, the dispatch's exchange sizes.
        overrides = {"model": {"arch": tiny_glm().model_dump()}, "parallel": {"ep": 2}}
        trainer = build(_config(tmp_path / "ep", **overrides), init_distributed(timeout_minutes=2, ep=2), "moe-ep")
        forwards = []
        for module in trainer.model.modules():
            if isinstance(module, Experts):
                module.register_forward_hook(lambda *_: forwards.append(1))
        detector, names = run_checked(trainer, monkeypatch)
        all_reads = reads(detector)
        ep_reads = [r for r in all_reads if r.startswith(EP_READ)]
        reduction = [r for r in all_reads if r.startswith(REDUCTION_READ)]
        found["moe-ep"] = [r for r in all_reads if r not in ep_reads and r not in reduction]
        found["moe-ep"] += ["no step"] * ("loss/mean" not in names)
        found["moe-ep"] += [f"{len(ep_reads)} reads in {len(forwards)} MoE forwards"] * (len(ep_reads) != len(forwards))
        found["moe-ep"] += [f"{len(reduction)} reduction reads in 2 steps"] * (len(reduction) != 2)
    cases = {
        "dense": {"model": {"arch": tiny_llama().model_dump(), "param_dtype": "bfloat16"}},
        "dense-deferred": {"model": {"arch": tiny_llama().model_dump(), "defer_grad_sync": True}},
        "moe-grouped-deferred": {"model": {"arch": tiny_glm().model_dump(), "defer_grad_sync": True}},
        "moe-loop": {"model": {"arch": tiny_glm().model_dump()}},
        "validation": _val_files(tmp_path / f"files{rank}"),
        "cp2": {"parallel": {"cp": 2}},
        "moe-quantile-cp2": {
            # the sequence-wise loss's choices summed over the CP pair
            "model": {"arch": tiny_glm().model_dump(), "moe_balance": {"rule": "quantile", "seq_aux_coeff": 0.01}},
            "parallel": {"cp": 2},
        },
        # hybrid sharding: 2 replica groups of one rank (the gradient norm's replica scaling, Muon on the groups)
        "hsdp": {"parallel": {"dp_replicate": 2}},
        # tensor parallelism: the vocabulary-sharded loss's all-reduces, Muon's TP gather, the counting rank
        "tp2": {"parallel": {"tp": 2}},
        "tp2-validation": {**_val_files(tmp_path / f"tpfiles{rank}"), "parallel": {"tp": 2}},
        # an MoE under TP: each rank routes its own tokens through experts held whole, with hyper-connections on
        # each rank's tokens of the stream and the sequence-wise loss's choices summed over the TP group
        "moe-grouped-tp2": {
            "model": {
                "arch": tiny_glm(hyper_connections=2).model_dump(),
                "defer_grad_sync": True,
                "moe_balance": {"seq_aux_coeff": 0.01},
            },
            "parallel": {"tp": 2},
        },
        # pipeline parallelism: torch's schedules (point-to-point sends of the hidden states and their gradients)
        "pp2": {"model": {"arch": tiny_llama(num_hidden_layers=4).model_dump()}, "parallel": {"pp": 2}},
        "pp2-zbv": {
            "model": {"arch": tiny_llama(num_hidden_layers=4).model_dump()},
            "parallel": {"pp": 2, "pp_schedule": "zbv"},
        },
        # an MoE cut into stages: each rank's rows of the step's routing tables
        "pp2-moe": {"model": {"arch": tiny_glm().model_dump()}, "parallel": {"pp": 2}},
    }
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, overrides in cases.items():
            if name in LONG_CASES and not LONG:
                continue
            config = _config(tmp_path / name, **overrides)
            ctx = init_distributed(timeout_minutes=2, **mesh_degrees(config.parallel))
            trainer = build(config, ctx, name)
            detector, names = run_checked(trainer, monkeypatch)
            found[name] = reads(detector) + (["no step"] * ("loss/mean" not in names))
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(found))
    shutdown_distributed()


@pytest.mark.slow
def test_two_processes_with_fsdp_never_read_the_device(tmp_path: Path) -> None:
    results = run_ranks(_two_rank_worker, (free_port(), str(tmp_path)), tmp_path, timeout=240)
    for rank, found in enumerate(results):
        every = {"dense", "dense-deferred", "moe-grouped-deferred", "moe-loop", "validation", "cp2", "moe-quantile-cp2",
                 "hsdp", "tp2", "tp2-validation", "moe-grouped-tp2", "pp2", "pp2-zbv", "pp2-moe", "moe-ep"}  # fmt: skip
        assert set(found) == (every if LONG else every - LONG_CASES)
        assert found["moe-ep"] == [], f"rank {rank}: {found['moe-ep']}"
        checked = {case: reads for case, reads in found.items() if case != "moe-ep"}
        assert all(expected_reads(case, reads) for case, reads in checked.items()), f"rank {rank}: {found}"


def _four_rank_worker(rank: int, port: int, tmp: str) -> None:
    join_as_rank(rank, port, world_size=4)
    from lmforge.parallel.process_group import shutdown_distributed

    tmp_path = Path(tmp)
    # pipeline stages split over TP pairs, validation scoring through them: each rank sends its half of the stream
    arch = tiny_llama(num_hidden_layers=4).model_dump()
    overrides = {**_val_files(tmp_path / f"files{rank}"), "model": {"arch": arch},
                 "parallel": {"pp": 2, "tp": 2, "pp_schedule": "zbv"}}  # fmt: skip
    config = _config(tmp_path / "pp2-tp2-zbv", **overrides)
    with pytest.MonkeyPatch.context() as monkeypatch:
        trainer = build(config, init_distributed(timeout_minutes=2, **mesh_degrees(config.parallel)), "pp2-tp2-zbv")
        detector, names = run_checked(trainer, monkeypatch)
    found = {"pp2-tp2-zbv": reads(detector) + (["no step"] * ("loss/mean" not in names))}
    found["pp2-tp2-zbv"] += ["no validation"] * ("val/words/bpb@64" not in names)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(found))
    shutdown_distributed()


@pytest.mark.slow
def test_four_processes_with_pipeline_and_tensor_parallelism_never_read_the_device(tmp_path: Path) -> None:
    results = run_ranks(_four_rank_worker, (free_port(), str(tmp_path)), tmp_path, timeout=240, n=4)
    for rank, found in enumerate(results):
        assert all(expected_reads(case, reads) for case, reads in found.items()), f"rank {rank}: {found}"
