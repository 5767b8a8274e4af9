"""Log-likelihood scoring of ctxcont and pairs sets: per-request scores and metrics agree with transformers scoring
one request at a time, and do not depend on the world size (2 FSDP2 ranks vs 1 process)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.scoring import pack_requests, score_requests
from lmforge.eval.sets import EvalSet, Request, build_requests, fit_requests, read_eval_set, set_metrics
from lmforge.hf.folder import write_model_files
from lmforge.hf.weights import write_safetensors
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from tests.chat import WORDS, chat_tokenizer, write_jsonl
from tests.conftest import require, tiny_llama
from tests.spawn import free_port, join_as_rank, run_ranks

transformers = require("transformers")

CPU = torch.device("cpu")
VOCAB = 384  # the test tokenizer's 331 ids, rounded up to 128
SEQ_LEN = 12  # short enough that the longer contexts are truncated
ROW_TOKENS = 36
STD, SEED = 0.2, 3  # a large std: choices differ clearly in likelihood, so the metrics are not decided by noise


def _words(start: int, n: int) -> str:
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(n))


def _write_sets(folder: Path) -> None:
    rng = np.random.default_rng(0)
    mc = []
    for i in range(14):
        context = _words(3 * i, int(rng.integers(1, 16))) + (" " if i % 3 == 0 else "")
        gap = "" if i % 3 == 0 else " "
        choices = [gap + _words(5 * i + 2 * c, int(rng.integers(1, 5))) for c in range(2 + i % 3)]
        mc.append({"context": context, "continuations": choices, "label": int(rng.integers(0, len(choices)))})
    write_jsonl(folder / "mc.ctxcont.jsonl", mc)
    pairs = []
    for i in range(9):
        good = _words(2 * i, 3 + i % 4)
        pairs.append({"good": good, "bad": " ".join(reversed(good.split()))})
    write_jsonl(folder / "bl.pairs.jsonl", pairs)


def _requests(folder: Path) -> tuple[list[EvalSet], list[list[Request]]]:
    """The two sets of `folder` and their requests at SEQ_LEN."""
    tok = load_tokenizer(folder / "tok")
    sets = [read_eval_set(folder / "mc.ctxcont.jsonl"), read_eval_set(folder / "bl.pairs.jsonl")]
    return sets, [fit_requests(build_requests(s.items, tok), SEQ_LEN, s.items) for s in sets]


def _model() -> CausalLM:
    model = build_model(tiny_llama(), VOCAB, "sdpa", CPU)
    init_weights(model, STD, seed=SEED)
    return model


def _hf_loglik(hf: torch.nn.Module, request: Request) -> float:
    """Sum of log p(continuation token | tokens before it), the request alone through transformers."""
    ids = torch.from_numpy(request.tokens)[None]
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits[0].float(), dim=-1)
    n = len(request.context)
    return float(logp[n - 1 : -1].gather(-1, ids[0, n:, None]).sum())


@pytest.fixture
def sets_dir(tmp_path: Path) -> Path:
    chat_tokenizer(tmp_path / "tok")
    _write_sets(tmp_path)
    return tmp_path


def test_scores_and_metrics_match_transformers(sets_dir: Path, one_thread: object) -> None:
    sets, requests = _requests(sets_dir)
    assert any(r.context[0] != load_tokenizer(sets_dir / "tok").eos_id for r in requests[0])  # some were truncated
    model = _model().train()
    write_model_files(sets_dir / "hf", model.arch, VOCAB, load_tokenizer(sets_dir / "tok"))
    write_safetensors(model.state_dict(), sets_dir / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(sets_dir / "hf", dtype=torch.float32,
                                                           local_files_only=True).eval()  # fmt: skip
    for s, reqs in zip(sets, requests, strict=True):
        rows = pack_requests(reqs, ROW_TOKENS)
        assert len(rows) > 1
        ours = score_requests(model, rows, len(reqs), CPU, 0, 1)
        assert model.training  # restored
        ref = np.array([_hf_loglik(hf, r) for r in reqs])
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
        metrics = set_metrics(s.kind, s.items, reqs, ours)
        assert metrics == set_metrics(s.kind, s.items, reqs, ref)
        assert set(metrics) == ({"acc", "acc_norm"} if s.kind == "ctxcont" else {"acc"})


def _worker(rank: int, port: int, folder: str) -> None:
    join_as_rank(rank, port)
    from lmforge.config.model import ModelConfig
    from lmforge.parallel.fsdp import parallelize
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed

    ctx = init_distributed(timeout_minutes=2)
    arch = tiny_llama()
    model = build_model(arch, VOCAB, "sdpa", ctx.device, meta=True)
    model = parallelize(model, model.blocks, ModelConfig(arch=arch, param_dtype="float32"), ctx)
    init_weights(model, STD, seed=SEED)
    _, requests = _requests(Path(folder))
    result = []
    for reqs in requests:
        rows = pack_requests(reqs, ROW_TOKENS)
        result.append(score_requests(model, rows, len(reqs), ctx.device, ctx.rank, ctx.world_size).tolist())
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_distributed()


@pytest.mark.slow
def test_two_fsdp_ranks_score_like_one_process(sets_dir: Path, one_thread: object) -> None:
    _, requests = _requests(sets_dir)
    # An odd number of rows: one rank runs a forward on a row it does not own (FSDP needs matched collectives).
    assert all(len(pack_requests(reqs, ROW_TOKENS)) % 2 == 1 for reqs in requests)
    model = _model()
    single = [score_requests(model, pack_requests(r, ROW_TOKENS), len(r), CPU, 0, 1) for r in requests]
    results = run_ranks(_worker, (free_port(), str(sets_dir)), sets_dir, timeout=180)
    assert results[0] == results[1]
    for one, two in zip(single, results[0], strict=True):
        np.testing.assert_allclose(np.array(two), one, rtol=0, atol=1e-5)
