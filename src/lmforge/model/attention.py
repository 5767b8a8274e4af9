"""Document-masked causal attention.

A packed row holds several segments (documents or samples). Attention must stay inside each segment and be
causal within it. Every backend here receives the same `DocumentMask`, built once per forward from the
micro-batch's `doc_lens`, and the same `[T, heads, head_dim]` tensors:

- `flash`: flash-attn's varlen kernel (CUDA, when the package is installed);
- `varlen`: PyTorch's `torch.nn.attention.varlen.varlen_attn` (CUDA);
- `flex`: PyTorch flex attention with a document block mask (compiled on CUDA; on CPU it has no backward);
- `sdpa`: scaled-dot-product attention with an explicit block-diagonal causal mask (runs anywhere);
- `sdpa_loop`: one causal SDPA call per segment (runs anywhere; the fused causal kernel, fast for few segments).

`auto` picks, for each micro-batch, the fastest of these that is exact for its layout and can train on the device
(`choose_backend`): the choice reads only the row's segment lengths, which are on the host, so it costs no device
synchronization. Plain causal SDPA over the whole row would let a segment see the one before it, so it is only
used per segment.

A layer may have a sliding window (`arch.attention_window`): each query then attends only the `window` keys ending
at itself, within its segment (a window never reaches across a segment's start). Every backend takes it: as a band
in its mask (`sdpa`, `flex`, and `sdpa_loop` for segments longer than the window), or as the kernel's window
argument (`flash`, `varlen`).

Value heads may be narrower than query/key heads (multi-head latent attention): `sdpa` and `flex` take that as
it is, the CPU flash kernel and the varlen kernels get the values zero-padded to the query/key width.

A layer may also have attention sinks (`lmforge.model.sinks`): a logit per query head in every softmax's
denominator. `sdpa_loop` on the CPU and `flex` rescale their output by the kernel's log-sum-exp; `sdpa` (and
`sdpa_loop` on CUDA) compute the softmax with the sink column written out; the varlen kernels refuse them, since
neither returns a log-sum-exp that carries a gradient.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.model.cpu_attention import cpu_segment_attention, equal_length_runs
from lmforge.model.masks import band_bias, causal_band, padded_values, window_allows
from lmforge.model.sinks import masked_sink_attention, sink_scale

BACKENDS = ("flash", "varlen", "flex", "sdpa", "sdpa_loop")
"""Names accepted by `model.attn`, besides `auto`."""

CPU_MASK_AREA_PER_CALL = 5500
"""On the CPU, `auto` runs a row of T tokens as the per-segment loop while its kernel calls (one per run of
equal-length neighbours) x this <= T x T, and as one SDPA with the block-diagonal mask above. The masked kernel
costs about T x T; the loop about a fixed cost per call on top of its (smaller) work. Measured with
`benchmarks/attention_switch.py` (docs/benchmarks.md) on segments whose neighbours differ in length: the loop
stops being faster at about 10 calls for T = 256, 48 for T = 512, 190 for T = 1024 and 768 for T = 2048."""


@dataclass
class DocumentMask:
    """Segment layout of one packed row, shared by every layer of a forward pass."""

    doc_lens: list[int]
    """Length of each segment, in order; they add up to the row length."""
    cu_seqlens: Tensor
    """int32 [S + 1] cumulative segment offsets on the compute device."""
    max_seqlen: int
    """Longest segment."""
    doc_ids: Tensor
    """int32 [T]: the segment index of each position, on the compute device."""
    cache: dict[str, object] = field(default_factory=dict)
    """Backend-specific masks, built on first use and reused by the other layers."""

    @classmethod
    def from_doc_lens(cls, doc_lens: Tensor, device: torch.device) -> DocumentMask:
        """Build the mask from a micro-batch's `doc_lens`.

        `doc_lens` should live on the CPU (as the data pipeline produces it): its values are needed on the
        host for `max_seqlen`, and reading them from the CPU costs no device synchronization.
        """
        lens = [int(n) for n in doc_lens.tolist()]
        if not lens or min(lens) <= 0:
            raise ValueError(f"doc_lens must be positive segment lengths, got {lens}")
        lens_t = torch.tensor(lens, dtype=torch.int32)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(lens_t, 0, out=cu[1:])
        # The output size from the host: no read of `lens_t` (and the mask can be built on fake tensors).
        doc_ids = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), lens_t, output_size=sum(lens))
        return cls(
            doc_lens=lens,
            cu_seqlens=cu.to(device, non_blocking=True),
            max_seqlen=max(lens),
            doc_ids=doc_ids.to(device, non_blocking=True),
        )

    @property
    def total(self) -> int:
        """Row length T."""
        return int(self.doc_ids.numel())


AttentionFn = Callable[[Tensor, Tensor, Tensor, DocumentMask, int | None, Tensor | None], Tensor]
"""q [T, Hq, D], k and v [T, Hkv, D], the row's mask, the layer's sliding window (None: full causal attention) and
its sinks [Hq] (None: none) -> output [T, Hq, D]."""


def _to_bhtd(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def _from_bhtd(x: Tensor) -> Tensor:
    return x.squeeze(0).transpose(0, 1)


def dense_document_mask(mask: DocumentMask, window: int | None = None) -> Tensor:
    """Boolean [T, T] mask: True where query i may attend to key j (same segment, j <= i, i - j < window)."""
    key = f"dense:{window}"
    dense = mask.cache.get(key)
    if dense is None:
        ids = mask.doc_ids
        same = ids[:, None] == ids[None, :]
        dense = torch.tril(same)
        if window is not None:
            pos = torch.arange(mask.total, device=ids.device)
            dense = dense & window_allows(pos[:, None], pos[None, :], window)
        mask.cache[key] = dense
    return dense  # type: ignore[return-value]


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """SDPA with an explicit block-diagonal causal mask (banded with a window); with sinks, the same mask in
    attention written out with the sink column."""
    if sinks is not None:
        allowed = dense_document_mask(mask, window)
        return _from_bhtd(masked_sink_attention(_to_bhtd(q), _to_bhtd(k), _to_bhtd(v), allowed, sinks))
    out = F.scaled_dot_product_attention(
        _to_bhtd(q),
        _to_bhtd(k),
        _to_bhtd(v),
        attn_mask=dense_document_mask(mask, window),
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return _from_bhtd(out)


# Compiled blocks run the per-row choice and the per-segment loop eagerly, between two compiled graphs: traced,
# the loop over a row's segments would make every new layout recompile (tests/unit/test_compile.py).
@torch.compiler.disable
def sdpa_loop_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """Causal SDPA per segment; consecutive segments of one length go in one batched call (a row of whole
    windows, the layout without document masking, is a single call). On the CPU, the flash kernel's calls with a
    backward of their own (`lmforge.model.cpu_attention`). Segments longer than the window get a band mask."""
    if q.device.type == "cpu":
        out = cpu_segment_attention(q, k, padded_values(v, q.shape[-1]), mask.doc_lens, window, sinks)
        return out[..., : v.shape[-1]]
    gqa = q.shape[1] != k.shape[1]
    outs, start = [], 0
    for length, count in equal_length_runs(mask.doc_lens):
        part = slice(start, start + length * count)
        # [count * length, heads, dim] -> [count, heads, length, dim]: one batch entry per segment.
        qs, ks, vs = (x[part].unflatten(0, (count, length)).transpose(1, 2) for x in (q, k, v))
        if sinks is not None:
            out = masked_sink_attention(qs, ks, vs, causal_band(length, window, q.device), sinks)
        elif window is not None and length > window:
            band = band_bias(length, window, q.dtype, q.device)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).flatten(0, 1))
        start += length * count
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


@functools.cache
def compiled_flex() -> Callable[..., Tensor]:
    """flex_attention compiled once per process (CUDA), shared by every layer and by context parallelism."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(mask: DocumentMask, window: int | None = None) -> object:
    """The flex-attention BlockMask of a document mask, banded by a sliding window (built once per forward)."""
    key = f"flex:{window}"
    block = mask.cache.get(key)
    if block is None:
        from torch.nn.attention.flex_attention import create_block_mask

        ids = mask.doc_ids

        def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            allowed = (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
            return allowed if window is None else allowed & (q_idx - kv_idx < window)

        block = create_block_mask(document_causal, None, None, mask.total, mask.total, device=ids.device)
        mask.cache[key] = block
    return block


def flex_attention_fn(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """Flex attention with a document block mask; compiled on CUDA, eager (forward only) on CPU. Sinks rescale
    the output by the log-sum-exp flex returns (its gradient flows through it)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    fn = compiled_flex() if q.is_cuda else flex_attention
    block = flex_block_mask(mask, window)
    qs, ks, vs = _to_bhtd(q), _to_bhtd(k), _to_bhtd(v)
    if sinks is None:
        return _from_bhtd(fn(qs, ks, vs, block_mask=block, enable_gqa=q.shape[1] != k.shape[1]))  # type: ignore[arg-type]
    out, aux = fn(qs, ks, vs, block_mask=block, enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    return _from_bhtd(out * sink_scale(aux.lse[0], sinks)[None, :, :, None].to(out.dtype))


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """PyTorch's varlen flash attention (CUDA). Handles both the torch 2.11 and the newer signature."""
    refuse_sinks("varlen", sinks)
    cu = mask.cu_seqlens
    return varlen_call(q, k, v, cu, cu, mask.max_seqlen, mask.max_seqlen, window)


def varlen_call(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, window: int | None = None
) -> Tensor:
    """Causal `varlen_attn` over packed sequences; where a query sequence is shorter than its key sequence, its
    queries are the last ones (the causal mask is aligned to the bottom right, as in flash attention). A window
    keeps the `window` keys ending at each query (the kernel's left window of window - 1)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs: dict[str, object] = {}
    if "is_causal" in params:
        if window is not None:
            raise ValueError("this torch's varlen_attn has no window argument; use model.attn = 'flex' or 'flash'")
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    out = varlen_attn(q, k, padded_values(v, q.shape[-1]), cu_q, cu_k, max_q, max_k, **kwargs)
    return out[..., : v.shape[-1]]  # type: ignore[no-any-return]


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """flash-attn's varlen kernel (CUDA, bf16/fp16); it supports grouped-query attention natively."""
    refuse_sinks("flash", sinks)
    cu = mask.cu_seqlens
    return flash_call(q, k, v, cu, cu, mask.max_seqlen, mask.max_seqlen, window)


def flash_call(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, window: int | None = None
) -> Tensor:
    """Causal `flash_attn_varlen_func` over packed sequences (bottom-right aligned, like `varlen_call`), with a
    left window of window - 1 keys when a window is given."""
    from flash_attn import flash_attn_varlen_func

    left = -1 if window is None else window - 1
    out = flash_attn_varlen_func(q, k, padded_values(v, q.shape[-1]), cu_q, cu_k, max_q, max_k, causal=True,
                                 window_size=(left, 0))  # fmt: skip
    return out[..., : v.shape[-1]]  # type: ignore[no-any-return]


def choose_backend(doc_lens: list[int], device: torch.device) -> str:
    """The backend `auto` runs for a row with these segment lengths on a device without a varlen kernel (with
    one, `resolve_backend` picks it for every row)."""
    if device.type == "cuda":
        # Segments of one length (one document, or whole windows without document masking) are one batched call
        # of the fused causal SDPA kernel; other layouts are flex attention's block-sparse kernel.
        return "sdpa_loop" if len(set(doc_lens)) == 1 else "flex"
    total = sum(doc_lens)
    return "sdpa_loop" if len(equal_length_runs(doc_lens)) * CPU_MASK_AREA_PER_CALL <= total * total else "sdpa"


def describe_backend(name: str, device: torch.device) -> str:
    """What a resolved backend runs on `device`, and why (logged once at startup)."""
    reasons = {
        "flash": "flash-attn's varlen kernel takes every segment layout in one call",
        "varlen": "PyTorch's varlen kernel takes every segment layout in one call (flash-attn is not installed)",
        "flex": "flex attention with a document block mask (no varlen kernel here)",
        "sdpa": "SDPA with a block-diagonal mask",
        "sdpa_loop": "causal SDPA per segment, equal-length neighbours batched",
    }
    if name != "auto":
        return f"{name}: {reasons[name]}"
    if device.type == "cuda":
        return (
            "auto: causal SDPA for rows whose segments all have one length, flex attention for the others (no varlen "
            "kernel here)"
        )
    return (
        "auto: the fused causal kernel per run of equal-length segments, or SDPA with a block-diagonal mask for rows "
        f"of T tokens that would need more than T x T / {CPU_MASK_AREA_PER_CALL} calls, where that was measured faster"
    )


def refuse_sinks(backend: str, sinks: Tensor | None) -> None:
    """A clear error where a varlen kernel would be asked for sinks, which it cannot compute with a gradient."""
    if sinks is not None:
        raise ValueError(
            f"model.attn = {backend!r} cannot compute attention sinks (its log-sum-exp carries no gradient); "
            "use 'flex' or 'auto'"
        )


@torch.compiler.disable
def auto_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """The backend `choose_backend` picks for this row (decided once per forward, shared by every layer)."""
    name = mask.cache.get("auto")
    if name is None:
        name = choose_backend(mask.doc_lens, q.device)
        mask.cache["auto"] = name
    return _FUNCTIONS[name](q, k, v, mask, window, sinks)  # type: ignore[index]


_FUNCTIONS: dict[str, AttentionFn] = {
    "flash": flash_attention,
    "varlen": varlen_attention,
    "flex": flex_attention_fn,
    "sdpa": sdpa_attention,
    "sdpa_loop": sdpa_loop_attention,
    "auto": auto_attention,
}


def backend_available(name: str, device: torch.device) -> bool:
    """Whether backend `name` can run forward and backward on `device`."""
    if name in ("sdpa", "sdpa_loop", "auto"):
        return True
    if device.type != "cuda":
        return False
    if name == "flash":
        return importlib.util.find_spec("flash_attn") is not None
    if name == "varlen":
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return name == "flex"


def resolve_backend(name: str, device: torch.device, compiled: bool = False, sinks: bool = False) -> str:
    """Check that backend `name` can train on `device`, and resolve `auto`: a varlen kernel when the device has
    one (it takes every layout), else `auto` itself, which chooses per row (`choose_backend`). On CUDA, compiled
    blocks without a varlen kernel get `flex`, which compiles into the block's graph. A model with attention
    `sinks` takes no varlen kernel (`refuse_sinks`): `auto` resolves as if there were none, and naming one is an
    error."""
    if name == "auto":
        varlen = [b for b in ("flash", "varlen") if backend_available(b, device) and not sinks]
        if varlen:
            return varlen[0]
        return "flex" if (compiled or sinks) and device.type == "cuda" else "auto"
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown attention backend {name!r}; expected auto or one of {', '.join(BACKENDS)}")
    if not backend_available(name, device):
        raise ValueError(f"attention backend {name!r} cannot train on {device.type}; use 'auto' or 'sdpa'")
    if sinks and name in ("flash", "varlen"):
        raise ValueError(f"model.attn = {name!r} cannot compute this architecture's attention sinks (its "
                         "log-sum-exp carries no gradient); use 'auto' or 'flex'")  # fmt: skip
    return name


def get_attention(name: str) -> AttentionFn:
    """The attention function of a resolved backend name."""
    return _FUNCTIONS[name]


_MASK_BUILDERS: dict[AttentionFn, Callable[[DocumentMask, int | None], object]] = {
    sdpa_attention: dense_document_mask,
    flex_attention_fn: flex_block_mask,
}
"""The per-forward mask each backend caches in `DocumentMask.cache` (the others need none, or choose per row)."""


def prepare_mask(attention: AttentionFn, mask: DocumentMask, windows: set[int | None]) -> None:
    """Build the masks `attention` reads (one per sliding window the layers use, None for full attention) before
    the decoder blocks run, once per forward: a block's forward then only reads the cache. Writing it from inside a
    checkpointed block that torch.compile traces is a side effect that the checkpoint's higher-order op refuses.
    Attention functions passed in from outside (context parallelism) build their masks at their first use."""
    builder = _MASK_BUILDERS.get(attention)
    if builder is not None:
        for window in windows:
            builder(mask, window)
