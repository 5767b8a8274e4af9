"""Context parallelism: one packed row split over the ranks of a context-parallel (CP) group.

A row of T tokens is cut into 2 x cp equal chunks and CP rank r holds chunks r and 2cp - 1 - r, so that every rank
gets as much causal attention work as the others (an early chunk attends to few keys, a late one to many). Every
rank of the group runs the model on its T / cp tokens (`shard_micro_batch` keeps its chunks of every per-token
tensor); attention gathers the keys and values of the whole row from the group (all-gather in forward, the
gradients summed back to their owners in backward) and lets each local query attend to the keys of its own
document at or before its position in the row. Documents may cross chunk and rank boundaries: the mask is built
from the whole row's segment lengths, which every rank of the group keeps.

The model knows nothing of this: `apply_context_parallel` passes `ContextAttention` in as every layer's attention
function. Its kernels: SDPA with an explicit [T / cp, T] boolean mask (any device), flex attention with a block mask
over the same layout (CUDA, compiled), or a varlen kernel (flash-attn's or PyTorch's, CUDA) over "pieces": each run
of local queries of one document within one chunk is a query sequence whose keys are its document from its start
up to the piece's last query (`varlen_layout`); the kernels align a shorter query sequence to the end of its keys,
so causality within the document holds exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lmforge.data.batch import MicroBatch
from lmforge.model.attention import (
    DocumentMask,
    compiled_flex,
    flash_call,
    refuse_sinks,
    resolve_backend,
    varlen_call,
)
from lmforge.model.llama import CausalLM
from lmforge.model.masks import padded_values, window_allows
from lmforge.model.seq_balance import TokenSplit
from lmforge.model.sinks import masked_sink_attention, sink_scale

CP_KERNELS = ("sdpa", "flex", "varlen", "flash")
"""Attention kernels under context parallelism."""


def chunk_index(total: int, rank: int, size: int) -> Tensor:
    """int64 positions in a row of `total` tokens that CP rank `rank` of `size` holds: chunk `rank`, then chunk
    `2 size - 1 - rank`, of 2 x size equal chunks."""
    return torch.from_numpy(chunk_positions(total, rank, size))


def chunk_positions(total: int, rank: int, size: int) -> np.ndarray:
    """`chunk_index` as a numpy array: host index math that stays real under `lmforge plan`'s fake tensors."""
    if total % (2 * size):
        raise ValueError(f"a row of {total} tokens does not split into 2 x cp = {2 * size} equal chunks")
    chunk = total // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return np.concatenate([np.arange(first, first + chunk, dtype=np.int64),
                           np.arange(second, second + chunk, dtype=np.int64)])  # fmt: skip


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its context-parallel group."""

    group: dist.ProcessGroup | None
    """The CP group (None only for size 1)."""
    rank: int
    """Rank within the group."""
    size: int
    """Ranks in the group (cp)."""
    kernel: str = "sdpa"
    """Attention kernel under CP, one of `CP_KERNELS`."""

    def index(self, total: int) -> Tensor:
        """Positions of this rank's tokens in a row of `total` tokens (CPU)."""
        return chunk_index(total, self.rank, self.size)

    def gathered_index(self, total: int) -> Tensor:
        """Row positions of the gathered keys: every rank's tokens, in rank order (CPU)."""
        return torch.from_numpy(np.concatenate([chunk_positions(total, r, self.size) for r in range(self.size)]))


@dataclass(frozen=True)
class VarlenLayout:
    """This rank's queries as packed sequences ("pieces") and the keys of each, for a varlen kernel."""

    cu_q: Tensor
    """int32 [P + 1]: offsets of the pieces in this rank's queries."""
    cu_k: Tensor
    """int32 [P + 1]: offsets of the pieces' key sequences in the packed keys."""
    key_index: Tensor
    """int64: the row position of every packed key (a key may serve several pieces of its document)."""
    max_q: int
    """Longest piece."""
    max_k: int
    """Longest key sequence."""


def varlen_layout(doc_lens: list[int], shard: ContextShard) -> VarlenLayout:
    """The pieces of this rank's queries in a row with segments `doc_lens` (see the module docstring); computed on
    the host from the segment lengths, with no device read."""
    total = sum(doc_lens)
    lens = np.asarray(doc_lens, dtype=np.int64)
    doc = np.repeat(np.arange(len(lens)), lens)
    doc_start = np.repeat(np.cumsum(lens) - lens, lens)
    local = chunk_positions(total, shard.rank, shard.size)
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(doc[local]) != 0)) + 1
    bounds = np.concatenate([[0], breaks, [len(local)]])
    first, last = local[bounds[:-1]], local[bounds[1:] - 1]
    starts = doc_start[first]
    q_lens, k_lens = np.diff(bounds), last + 1 - starts
    key_index = np.concatenate([np.arange(a, b + 1) for a, b in zip(starts, last, strict=True)])
    cu = lambda n: torch.from_numpy(np.concatenate([[0], np.cumsum(n)]).astype(np.int32))  # noqa: E731
    return VarlenLayout(cu(q_lens), cu(k_lens), torch.from_numpy(key_index), int(q_lens.max()), int(k_lens.max()))


class _GatherRow(torch.autograd.Function):
    """All-gather along the token dimension; backward sums each rank's gradient slice back to its owner."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, shard: ContextShard) -> Tensor:  # type: ignore[override]
        ctx.shard = shard  # type: ignore[attr-defined]
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        shard: ContextShard = ctx.shard  # type: ignore[attr-defined]
        grad = grad.contiguous()
        local = grad.shape[0] // shard.size
        if grad.is_cuda:  # NCCL
            out = torch.empty((local, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=shard.group)
            return out, None
        # gloo (CPU tensors) has no reduce-scatter: sum everything, keep this rank's slice.
        dist.all_reduce(grad, group=shard.group)
        return grad[shard.rank * local : (shard.rank + 1) * local].clone(), None


def gather_row(x: Tensor, shard: ContextShard) -> Tensor:
    """[T / cp, ...] on every rank of the group -> [T, ...] in rank order, differentiable."""
    return _GatherRow.apply(x, shard)  # type: ignore[no-any-return]


def _positions(doc_ids: Tensor, shard: ContextShard) -> tuple[Tensor, Tensor]:
    """Row positions of this rank's queries and of the gathered keys, on the device of `doc_ids`."""
    total = doc_ids.numel()
    return shard.index(total).to(doc_ids.device), shard.gathered_index(total).to(doc_ids.device)


def context_mask(doc_ids: Tensor, shard: ContextShard, cache: dict[str, object], window: int | None = None) -> Tensor:
    """Boolean [T / cp, T]: local query i may attend gathered key j (same document, not after it in the row, and
    within the sliding window when there is one)."""
    key = f"cp_dense:{window}"
    dense = cache.get(key)
    if dense is None:
        q_pos, k_pos = _positions(doc_ids, shard)
        qp, kp = q_pos[:, None], k_pos[None, :]
        dense = (doc_ids[q_pos][:, None] == doc_ids[k_pos][None, :]) & (kp <= qp) & window_allows(qp, kp, window)
        cache[key] = dense
    return dense  # type: ignore[return-value]


def _flex_mask(doc_ids: Tensor, shard: ContextShard, cache: dict[str, object], window: int | None) -> object:
    key = f"cp_flex:{window}"
    block = cache.get(key)
    if block is None:
        from torch.nn.attention.flex_attention import create_block_mask

        q_pos, k_pos = _positions(doc_ids, shard)

        def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            qp, kp = q_pos[q_idx], k_pos[kv_idx]
            allowed = (doc_ids[qp] == doc_ids[kp]) & (kp <= qp)
            return allowed if window is None else allowed & (qp - kp < window)

        block = create_block_mask(document_causal, None, None, len(q_pos), len(k_pos), device=doc_ids.device)
        cache[key] = block
    return block


@dataclass(frozen=True)
class ContextAttention:
    """The attention function of every layer under context parallelism (an `AttentionFn`): this rank's queries
    over the whole row's keys and values, gathered from the CP group."""

    shard: ContextShard
    """This rank's place in its CP group, with the kernel."""

    @torch.compiler.disable
    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: DocumentMask,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """q [T / cp, Hq, D], this rank's k and v [T / cp, Hkv, D], the mask of the whole row, the layer's
        sliding window and sinks -> [T / cp, Hq, D]."""
        # One collective for both; narrower value heads (MLA) travel zero-padded to the key width.
        kv = gather_row(torch.cat([k, padded_values(v, k.shape[-1])], dim=1), self.shard)
        return attend_gathered(q, kv, k.shape[1], mask, self.shard, window, sinks)[..., : v.shape[-1]]


def attend_gathered(
    q: Tensor,
    kv: Tensor,
    kv_heads: int,
    mask: DocumentMask,
    shard: ContextShard,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """This rank's queries [T / cp, Hq, D] over the gathered keys and values `kv` [T, 2 x kv_heads, D] (every
    rank's, in rank order, keys before values along the head dimension), with the kernel of `shard`; `mask`
    describes the whole row. With a sliding window, each query keeps the `window` row positions ending at its own
    (a band in the mask, or the varlen kernels' window, which counts from each query's bottom-right-aligned
    place in its document's keys). Sinks join each query's softmax as without CP (`lmforge.model.sinks`): every
    query's denominator holds all of its keys, gathered, so the sink enters it once."""
    doc_ids, cache = mask.doc_ids, mask.cache
    if shard.kernel in ("varlen", "flash"):
        refuse_sinks(shard.kernel, sinks)
        layout = cache.get("cp_varlen")
        if layout is None:
            layout = varlen_layout(mask.doc_lens, shard)
            # gathered (rank order) -> packed keys: one index, moved to the device once per forward
            rank_order = shard.gathered_index(mask.total)
            to_gathered = torch.empty_like(rank_order)
            to_gathered[rank_order] = torch.arange(len(rank_order))
            index = to_gathered[layout.key_index].to(q.device)
            layout = (layout, index, layout.cu_q.to(q.device), layout.cu_k.to(q.device))
            cache["cp_varlen"] = layout
        plan, index, cu_q, cu_k = layout  # type: ignore[misc]
        k_packed, v_packed = kv[index].split([kv_heads, kv_heads], dim=1)
        call = flash_call if shard.kernel == "flash" else varlen_call
        return call(q, k_packed, v_packed, cu_q, cu_k, plan.max_q, plan.max_k, window)
    k_all, v_all = kv.split([kv_heads, kv_heads], dim=1)
    gqa = q.shape[1] != kv_heads
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k_all, v_all))
    if shard.kernel == "flex":
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        fn = compiled_flex() if q.is_cuda else flex_attention  # eager on the CPU (forward only), as without CP
        block = _flex_mask(doc_ids, shard, cache, window)
        if sinks is None:
            out = fn(qs, ks, vs, block_mask=block, enable_gqa=gqa)
        else:
            out, aux = fn(qs, ks, vs, block_mask=block, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
            out = out * sink_scale(aux.lse[0], sinks)[None, :, :, None].to(out.dtype)
    elif sinks is not None:
        out = masked_sink_attention(qs, ks, vs, context_mask(doc_ids, shard, cache, window), sinks)
    else:
        dense = context_mask(doc_ids, shard, cache, window)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=dense, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)  # type: ignore[union-attr]


def context_kernel(attn: str, device: torch.device, sinks: bool = False) -> str:
    """The attention kernel under context parallelism for `model.attn`: the backend it names, or for `auto` the one
    `auto` resolves to that takes a split row (a varlen kernel, else flex attention, on CUDA; SDPA with an explicit
    mask on the CPU; with attention `sinks`, no varlen kernel). `sdpa_loop` takes no split row (refused when the
    config is checked)."""
    name = resolve_backend(attn, device, sinks=sinks)
    if name == "auto":
        name = "flex" if device.type == "cuda" else "sdpa"
    if name not in CP_KERNELS:
        raise ValueError(f"model.attn = {attn!r} does not run under context parallelism; use one of "
                         f"auto, {', '.join(CP_KERNELS)}")  # fmt: skip
    return name


def apply_context_parallel(model: CausalLM, shard: ContextShard) -> None:
    """Pass `ContextAttention` of `shard` into every layer of `model`, which then takes this rank's T / cp tokens
    of each row and the whole row's segment lengths."""
    model.model.use_attention(ContextAttention(shard), row_split=shard.size)
    assert shard.group is not None
    for block in model.moe_layers().values():
        # The sequence-wise balance loss counts each segment's choices over the whole row: this rank's chunks, and
        # under tensor parallelism (applied first) its run of their tokens.
        tp = block.token_split or TokenSplit(())
        mine = (shard.rank, 2 * shard.size - 1 - shard.rank)
        block.token_split = replace(tp, groups=(shard.group, *tp.groups), chunks=2 * shard.size, mine=mine)


def shard_micro_batch(mb: MicroBatch, shard: ContextShard) -> MicroBatch:
    """This rank's part of `mb`: its chunks of every per-token tensor, the whole row's `doc_lens` (the model builds
    the attention mask of the whole row from it), and the row's counts (`source_tokens`) on CP rank 0 only, so the
    step's sums over all ranks count every token once; `mb` itself when CP is off."""
    if shard.size == 1:
        return mb
    index = shard.index(mb.tokens)
    split = {name: getattr(mb, name)[:, index] for name in MicroBatch.PER_TOKEN}
    counts = mb.source_tokens
    if counts is not None and shard.rank != 0:
        counts = torch.zeros_like(counts)
    return replace(mb, **split, source_tokens=counts)
