"""Context parallelism: the chunk layout, micro-batch splits, config checks, and attention over a CP group (2 and
4 gloo processes) equal to single-process document-masked attention, forward and backward, for the SDPA and flex
kernels and for the varlen kernels' packing (run with a CPU stand-in of the CUDA kernel)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config.checks import context_problems
from lmforge.data.batch import MicroBatch
from lmforge.model.attention import DocumentMask, sdpa_attention
from lmforge.parallel.context import ContextShard, chunk_index, shard_micro_batch
from tests.spawn import free_port, join_as_rank, run_ranks

# Documents cross chunk and rank boundaries; one (20 tokens) is longer than a chunk of 64 / (2 x 4) = 8.
DOC_LENS = [5, 20, 3, 9, 1, 14, 12]
T, HQ, HKV, D = 64, 4, 2, 8


def test_chunks_are_balanced_and_cover_the_row_once() -> None:
    for size in (1, 2, 4):
        parts = [chunk_index(T, r, size) for r in range(size)]
        assert sorted(torch.cat(parts).tolist()) == list(range(T))
        # rank r holds chunk r and chunk 2cp-1-r: every rank attends about the same number of causal pairs
        work = [int((p + 1).sum()) for p in parts]
        assert len(set(work)) == 1
    assert chunk_index(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_index(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="does not split into 2 x cp = 8 equal chunks"):
        chunk_index(20, 0, 4)


def test_varlen_pieces_are_runs_of_one_document_in_one_chunk() -> None:
    from lmforge.parallel.context import varlen_layout

    # a row of 16 in chunks of 4: rank 0 holds [0, 4) and [12, 16), rank 1 [4, 12); documents [0, 3) [3, 14) [14, 16)
    zero, one = (varlen_layout([3, 11, 2], ContextShard(None, r, 2)) for r in range(2))
    assert zero.cu_q.tolist() == [0, 3, 4, 6, 8] and zero.cu_k.tolist() == [0, 3, 4, 15, 17]
    assert zero.key_index.tolist() == [0, 1, 2, 3, *range(3, 14), 14, 15]
    assert (zero.max_q, zero.max_k) == (3, 11)
    assert one.cu_q.tolist() == [0, 8] and one.cu_k.tolist() == [0, 9] and one.key_index.tolist() == list(range(3, 12))


def test_a_micro_batch_split_keeps_tokens_aligned_and_the_row_whole() -> None:
    mb = MicroBatch(
        input_ids=torch.arange(16)[None],
        target_ids=torch.arange(1, 17)[None],
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1]]),
        loss_mask=torch.arange(16)[None] % 3 != 0,
        doc_lens=torch.tensor([3, 11, 2], dtype=torch.int32),
        source_tokens=torch.tensor([10, 6]),
    )
    parts = [shard_micro_batch(mb, ContextShard(None, r, 2)) for r in range(2)]
    for p, r in zip(parts, range(2), strict=True):
        index = chunk_index(16, r, 2)
        for key in ("input_ids", "target_ids", "position_ids", "loss_mask"):
            assert torch.equal(getattr(p, key), getattr(mb, key)[:, index])
        assert torch.equal(p.doc_lens, mb.doc_lens)
    assert parts[0].source_tokens.tolist() == [10, 6] and parts[1].source_tokens.tolist() == [0, 0]
    assert int(sum(p.loss_mask.sum() for p in parts)) == int(mb.loss_mask.sum())
    assert shard_micro_batch(mb, ContextShard(None, 0, 1)) is mb
    # Every per-token field of the micro-batch is split: a field added to it must be named in PER_TOKEN or not be
    # one entry per token.
    per_token = {f.name for f in dataclasses.fields(MicroBatch) if getattr(mb, f.name) is not None
                 and getattr(mb, f.name).shape[-1:] == (16,) and f.name != "doc_lens"}  # fmt: skip
    assert per_token == set(MicroBatch.PER_TOKEN)


def _inputs(values: int = D) -> tuple[torch.Tensor, ...]:
    """q, k [T, heads, D], and v and the output's gradient with `values` channels per head (narrower for MLA)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(T, h, d, generator=gen) for h, d in ((HQ, D), (HKV, D), (HKV, values), (HQ, values)))
    return q, k, v, grad


def _reference(values: int = D) -> dict[str, list[float]]:
    q, k, v, grad = (x.double() for x in _inputs(values))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), torch.device("cpu"))
    out = sdpa_attention(q, k, v, mask)
    out.backward(grad)
    return {"out": out.tolist(), "dq": q.grad.tolist(), "dk": k.grad.tolist(), "dv": v.grad.tolist()}


def bottom_right_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                       max_q: int, max_k: int, window: int | None = None) -> torch.Tensor:  # fmt: skip
    """What the CUDA varlen kernels compute (flash attention's semantics), on the CPU: causal attention per packed
    sequence, a query sequence shorter than its keys aligned to their end, with a left window of window - 1 keys
    (counted from that aligned place)."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        assert len(qs) <= max_q and len(ks) <= max_k
        place = torch.arange(len(qs))[:, None] + (len(ks) - len(qs))
        allowed = torch.arange(len(ks))[None, :] <= place
        if window is not None:
            allowed &= torch.arange(len(ks))[None, :] > place - window
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, enable_gqa=True)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def _worker(rank: int, port: int, size: int, kernel: str, folder: str, values: int) -> None:
    join_as_rank(rank, port, size)
    import torch.distributed as dist

    import lmforge.parallel.context as context
    from lmforge.parallel.context import ContextAttention

    context.varlen_call = bottom_right_varlen  # the kernel is CUDA-only; its packing is what runs here
    dist.init_process_group("gloo")
    try:
        shard = ContextShard(dist.new_group(list(range(size))), rank, size, kernel)
        index = shard.index(T)
        q, k, v, grad = (x.double()[index] for x in _inputs(values))
        backward = kernel != "flex"  # flex attention has no backward on the CPU
        if backward:
            q, k, v = (x.requires_grad_() for x in (q, k, v))
        mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), torch.device("cpu"))
        out = ContextAttention(shard)(q, k, v, mask)
        result = {"index": index.tolist(), "out": out.tolist()}
        if backward:
            out.backward(grad)
            result |= {"dq": q.grad.tolist(), "dk": k.grad.tolist(), "dv": v.grad.tolist()}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("size", "kernel", "values"),
    [
        (2, "sdpa", D),
        (4, "sdpa", D),
        (2, "flex", D),
        (2, "varlen", D),
        (4, "varlen", D),
        (2, "sdpa", 5),
        (2, "varlen", 5),
    ],
)
def test_attention_over_a_cp_group_equals_one_process(tmp_path: Path, size: int, kernel: str, values: int) -> None:
    # values 5 < D: value heads narrower than query/key heads (MLA) travel zero-padded and come back cut.
    ref = {k: np.asarray(v) for k, v in _reference(values).items()}
    results = run_ranks(_worker, (free_port(), size, kernel, str(tmp_path), values), tmp_path, timeout=120, n=size)
    for result in results:
        index = np.asarray(result["index"])
        for key in ("out",) if kernel == "flex" else ("out", "dq", "dk", "dv"):
            np.testing.assert_allclose(np.asarray(result[key]), ref[key][index], rtol=0, atol=1e-10, err_msg=key)


class _Config:
    """The fields `context_problems` reads."""

    def __init__(self, cp: int, seq_len: int = 64, micro: int = 128, attn: str = "auto",
                 seq_aux: float = 0.0) -> None:  # fmt: skip
        from types import SimpleNamespace as NS

        self.parallel = NS(cp=cp)
        self.data = NS(seq_len=seq_len, micro_batch_tokens=micro)
        self.model = NS(attn=attn, moe_balance=NS(seq_aux_coeff=seq_aux), arch=None)


def test_each_bad_layout_has_its_message() -> None:
    assert context_problems(_Config(1), 3) == []
    assert context_problems(_Config(2), 4) == []
    found = dict(context_problems(_Config(4, seq_len=60, micro=132, attn="sdpa_loop", seq_aux=0.1), 6))
    assert found == {
        "parallel.cp": "4 does not divide the world size 6",
        "data.seq_len": "60 does not split into 2 x parallel.cp = 8 equal chunks",
        "data.micro_batch_tokens": "132 does not split into 2 x parallel.cp = 8 equal chunks",
        "model.attn": "'sdpa_loop' does not run under parallel.cp > 1; use auto, sdpa, flex, varlen, flash",
    }  # the sequence-wise balance loss runs under CP (its choices summed over the row's ranks)


def _kernel_check(kernel: str, device: str, dtype: torch.dtype, atol: float, backward: bool,
                  window: int | None = None) -> None:  # fmt: skip
    """Every rank's part of CP attention, computed in one process from the keys and values its group would gather,
    against document-masked attention over the whole row: outputs, the queries' gradients, and the keys' and
    values' gradients summed over the ranks."""
    from lmforge.parallel.context import attend_gathered

    dev = torch.device(device)
    q, k, v, grad = (x.to(dev, dtype) for x in _inputs())
    ref_in = [x.clone().requires_grad_(backward) for x in (q, k, v)]
    mask = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), dev)
    ref = sdpa_attention(*ref_in, mask, window)
    if backward:
        ref.backward(grad)
    for size in (2, 4):
        dkv = torch.zeros(T, 2 * HKV, D, device=dev, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        for rank in range(size):
            shard = ContextShard(None, rank, size, kernel)
            index, gathered = shard.index(T).to(dev), shard.gathered_index(T).to(dev)
            local_q = q[index].clone().requires_grad_(backward)
            kv = torch.cat([k, v], dim=1)[gathered].clone().requires_grad_(backward)
            part = DocumentMask.from_doc_lens(torch.tensor(DOC_LENS), dev)
            out = attend_gathered(local_q, kv, HKV, part, shard, window)
            torch.testing.assert_close(out.float(), ref[index].float(), atol=atol, rtol=0)
            if backward:
                out.backward(grad[index])
                torch.testing.assert_close(local_q.grad.float(), ref_in[0].grad[index].float(), atol=atol, rtol=0)
                dkv[gathered] += kv.grad.to(dkv.dtype)
        if backward:
            torch.testing.assert_close(dkv[:, :HKV], ref_in[1].grad.to(dkv.dtype), atol=atol, rtol=0)
            torch.testing.assert_close(dkv[:, HKV:], ref_in[2].grad.to(dkv.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 1, 6], ids=["full", "window1", "window6"])
@pytest.mark.parametrize("kernel", ["sdpa", "varlen", "flex"])
def test_each_ranks_part_on_the_cpu(kernel: str, window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A window of 6 keys: documents (20, 14, 12, 9 tokens) longer and shorter than it, across chunks and ranks.
    import lmforge.parallel.context as context

    monkeypatch.setattr(context, "varlen_call", bottom_right_varlen)  # the CUDA kernel's semantics, on the CPU
    _kernel_check(kernel, "cpu", torch.float64, atol=1e-10, backward=kernel != "flex", window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["sdpa", "flex", "varlen", "flash"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_each_ranks_part_on_cuda_bf16(kernel: str, window: int | None) -> None:
    """The CUDA kernels themselves under the CP layout (flex's block mask, the varlen kernels' bottom-right
    alignment over packed pieces, and their window arguments)."""
    from lmforge.model.attention import backend_available

    if not backend_available(kernel, torch.device("cuda")):
        pytest.skip(f"{kernel} not available here")
    _kernel_check(kernel, "cuda", torch.bfloat16, atol=2e-2, backward=True, window=window)
