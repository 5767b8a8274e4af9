"""Decoder of the Llama family (Llama, Qwen3, and the MoE decoders GLM-4.5, Qwen3-MoE and gpt-oss) with HF parameter
names.

Module and parameter names are exactly those of `transformers`' `LlamaForCausalLM` / `Qwen3ForCausalLM` /
`Glm4MoeForCausalLM` / `Qwen3MoeForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...), so a state dict
moves between the two without renaming; gpt-oss's router and expert layouts differ, and `lmforge.hf.names` maps
them. A forward pass takes one packed row and its segment lengths; positions
and attention restart per segment.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lmforge.config.arch import AnyArch
from lmforge.config.arch_deepseek import DeepseekV3Arch
from lmforge.model.attention import AttentionFn, DocumentMask, get_attention, prepare_mask
from lmforge.model.aux_loss import with_aux_gradient
from lmforge.model.hyper_connections import HyperConnection, collapse_stream, expand_stream, stream_rate
from lmforge.model.loss import IGNORE_INDEX, head_cross_entropy, head_losses, head_token_losses
from lmforge.model.mla import MLAttention
from lmforge.model.mlp import MLP
from lmforge.model.moe import MoE
from lmforge.model.mtp import SharedHead, mtp_targets
from lmforge.model.norm import RMSNorm
from lmforge.model.params import ParamCounts, active_fractions, count_params
from lmforge.model.rotary import apply_rotary, rotary_cos_sin
from lmforge.model.vocab_parallel import VocabShard, sharded_embedding, vocab_shard


def exclusive(out: Tensor, v: Tensor) -> Tensor:
    """Exclusive self attention (XSA, Zhai, arXiv 2603.09078): each head's output out [T, Hq, D] without its
    component along the token's own value vector v [T, Hkv, D] (query head h reads KV head h // (Hq / Hkv)):
    y - (y . v) v / |v|^2, computed in fp32. A zero value vector leaves the output as it is."""
    t, hq, d = out.shape
    hkv = v.shape[1]
    y = out.float().view(t, hkv, hq // hkv, d)
    own = v.float().unsqueeze(2)
    along = (y * own).sum(-1, keepdim=True) / own.square().sum(-1, keepdim=True).clamp_min(1e-12)
    return (y - along * own).view(t, hq, d).to(out.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and optional per-head QK-norm; research options (GLM-4.5 family)
    change the heads' output before `o_proj` (`output`): exclusive self attention, then a sigmoid output gate."""

    def __init__(self, arch: AnyArch, attention: AttentionFn, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        """This block's sliding window (keys per query, itself included); None: full causal attention."""
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.kv_heads
        self.head_dim = arch.dim_per_head
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=arch.o_proj_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if arch.attention_sinks else None
        """gpt-oss's learned sink logit per query head: a column of every softmax that takes probability mass and
        contributes no value (`lmforge.model.sinks`)."""
        self.init_rules = {"sinks": "zero"} if self.sinks is not None else {}
        """Sinks start at 0: each softmax begins as if one more key with zero score and value were present."""
        self.attention = attention
        self.xsa = bool(getattr(arch, "xsa", False))
        self.gate = getattr(arch, "attn_output_gate", "none")
        if self.gate != "none":
            gates = self.num_heads * (self.head_dim if self.gate == "elementwise" else 1)
            self.g_proj = nn.Linear(arch.hidden_size, gates, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], with QK-norm and RoPE applied to q and k.

        Shared by the training forward and the KV-cached inference path (`lmforge.model.generate`).
        """
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def output(self, out: Tensor, x: Tensor, v: Tensor) -> Tensor:
        """The heads' outputs out [T, Hq, D] of input x [T, hidden] (normed) and its values v -> o_proj's result:
        with `xsa`, each head's output loses its component along the token's own value; with an output gate, it is
        multiplied by sigmoid(g_proj(x)) per head (`headwise`) or per channel (`elementwise`). Shared by the
        training forward and the KV-cached inference path."""
        t = x.shape[0]
        if self.xsa:
            out = exclusive(out, v)
        if self.gate != "none":
            gate = torch.sigmoid(self.g_proj(x)).view(t, self.num_heads, -1)
            out = out * gate.to(out.dtype)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def local_sinks(self) -> Tensor | None:
        """The sinks of the heads this rank computes: under tensor parallelism the parameter is split over the
        heads like the query projection, and attention runs on the local heads."""
        sinks = self.sinks
        return sinks.to_local() if isinstance(sinks, DTensor) else sinks

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = self.qkv(x, cos, sin)
        out = self.attention(q, k, v, mask, self.window, self.local_sinks())
        return self.output(out.reshape(x.shape[0], self.num_heads, self.head_dim), x, v)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: attention then the MLP (dense or MoE), each on a residual branch, or with
    hyper-connections (`arch.hyper_connections`) each behind a hyper-connection of its own (`attn_hc`, `mlp_hc`)."""

    def __init__(self, arch: AnyArch, attention: AttentionFn, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_after_scale)
        window = arch.attention_window(index)
        self.self_attn: Attention | MLAttention = (
            MLAttention(arch, attention, window)
            if isinstance(arch, DeepseekV3Arch)
            else Attention(arch, attention, window)
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_after_scale)
        spec = arch.moe
        self.mlp: MLP | MoE = (
            MoE(spec, arch.hidden_size)
            if spec is not None and arch.is_moe_layer(index)
            else MLP(arch.hidden_size, arch.intermediate_size, arch.mlp_act)
        )
        self.attn_hc: HyperConnection | None = None
        self.mlp_hc: HyperConnection | None = None
        rate = stream_rate(arch)
        if rate:
            dynamic = bool(getattr(arch, "hyper_connections_dynamic", True))
            hidden, eps = arch.hidden_size, arch.rms_norm_eps
            # The paper counts attention and the MLP as two layers: block i holds sub-layers 2i and 2i + 1.
            self.attn_hc = HyperConnection(rate, hidden, 2 * index, RMSNorm(hidden, eps) if dynamic else None)
            self.mlp_hc = HyperConnection(rate, hidden, 2 * index + 1, RMSNorm(hidden, eps) if dynamic else None)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        """x [T, hidden] -> [T, hidden]; with hyper-connections the stream [n, T, hidden] -> [n, T, hidden]."""
        if self.attn_hc is not None and self.mlp_hc is not None:
            x = self.attn_hc(x, lambda h: self.self_attn(self.input_layernorm(h), cos, sin, mask))
            return self.mlp_hc(x, lambda h: self._mlp(self.post_attention_layernorm(h), mask))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self._mlp(self.post_attention_layernorm(x), mask)

    def _mlp(self, h: Tensor, mask: DocumentMask) -> Tensor:
        """The MLP branch on normed h: an MoE block takes the mask (its sequence-wise loss needs the segments)."""
        return self.mlp(h, mask) if isinstance(self.mlp, MoE) else self.mlp(h)


class MtpLayer(DecoderLayer):
    """A multi-token-prediction module (`lmforge.model.mtp`): a decoder block with MTP's input projection of the
    previous depth's hidden state and the next tokens' embeddings, and its own output norm."""

    def __init__(self, arch: AnyArch, attention: AttentionFn, index: int) -> None:
        super().__init__(arch, attention, index)
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, eps)

    def forward(self, previous: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor,  # type: ignore[override]
                mask: DocumentMask) -> Tensor:  # fmt: skip
        """previous [T, hidden] (depth k - 1's output), embeds [T, hidden] (of tokens t + k) -> depth k's normed
        hidden state [T, hidden]."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous)), dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, mask))


class AbsentLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds (`lmforge.parallel.pipeline`): it keeps the
    layer indices, and so every parameter name, of the layers this rank holds."""

    def forward(self, *args: object) -> Tensor:
        """Never called: a stage runs only its own layers."""
        raise RuntimeError("this decoder layer is held by another pipeline stage")


def is_present(layer: nn.Module) -> bool:
    """Whether this rank holds `layer` (not an `AbsentLayer` left by a pipeline split)."""
    return not isinstance(layer, AbsentLayer)


def head_inputs(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, VocabShard | None]:
    """The LM head's input, weight and vocabulary shard: under tensor parallelism the head is split over the
    vocabulary (`lmforge.model.vocab_parallel.vocab_shard`), otherwise they pass through."""
    if isinstance(weight, DTensor):
        return vocab_shard(hidden, weight)
    return hidden, weight, None


def head_position_losses(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """Each position's fp32 cross-entropy [T] of the final hidden states [T, hidden] against targets [T] through the
    LM head `weight` (scoring, no gradient), `chunk_tokens` at a time (0: 1024)."""
    h, weight, shard = head_inputs(hidden, weight)
    return head_token_losses(h, weight, targets, chunk_tokens or 1024, shard)


def head_loss(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """The fp32 sum of the token cross-entropies of the final hidden states [T, hidden] against targets [T]
    (IGNORE_INDEX where there is no loss), through the LM head `weight`, `chunk_tokens` at a time (0: at once)."""
    return head_loss_and_z(hidden, weight, targets, chunk_tokens)[0]


def head_loss_and_z(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, z_loss: float = 0.0
) -> tuple[Tensor, Tensor | None]:
    """`head_loss`, whose gradient with `z_loss` > 0 is that of the cross-entropy + z_loss x the sum of lse^2 over
    the loss tokens, and that sum (detached; None when `z_loss` is 0) (`lmforge.model.loss.head_losses`)."""
    h, weight, shard = head_inputs(hidden, weight)
    return head_losses(h, weight, targets, chunk_tokens, shard, z_loss)


class DecoderModel(nn.Module):
    """Embedding, decoder blocks and final norm (HF's `model.` prefix)."""

    def __init__(self, arch: AnyArch, vocab_size: int, attention: AttentionFn) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, attention, i) for i in range(arch.num_hidden_layers))
        depths = getattr(arch, "num_nextn_predict_layers", 0)
        self.mtp_layers = nn.ModuleList(MtpLayer(arch, attention, arch.num_hidden_layers + k) for k in range(depths))
        """DeepSeek-V3's multi-token-prediction modules, depth 1 first (empty without them)."""
        self.attention = attention
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_after_scale)
        self.row_split = 1
        """Ranks each row is split over: under context parallelism (`lmforge.parallel.context`) the inputs are this
        rank's T / row_split tokens of a row, and `doc_lens` describes the whole row."""

    def use_attention(self, attention: AttentionFn, row_split: int = 1) -> None:
        """Run every layer's attention through `attention` instead of the built backend, for inputs that hold
        1 / row_split of each row: how context parallelism passes its kernel in."""
        self.attention, self.row_split = attention, row_split
        for layer in [*self.layers, *self.mtp_layers]:
            if is_present(layer):
                layer.self_attn.attention = attention

    def forward(self, input_ids: Tensor, position_ids: Tensor, doc_lens: Tensor) -> Tensor:
        """input_ids and position_ids [1, T], doc_lens [S] -> final hidden states [1, T, hidden] (under context
        parallelism, this rank's T / cp tokens of a row whose segments `doc_lens` gives)."""
        return self.decode(*self.inputs(input_ids, position_ids, doc_lens)).unsqueeze(0)

    def inputs(self, input_ids: Tensor, position_ids: Tensor, doc_lens: Tensor) -> tuple[Tensor, Tensor, Tensor,
                                                                                             DocumentMask]:  # fmt: skip
        """The blocks' inputs: the token embeddings [T, hidden], the rotary tables and the row's document mask,
        built once per forward and shared by every block (the MTP modules too)."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"a micro-batch is one packed row; got batch size {input_ids.shape[0]}")
        x = self.embed(input_ids[0])
        return x, *self.row_context(x, position_ids, doc_lens)

    def embed(self, ids: Tensor) -> Tensor:
        """The token embeddings [T, hidden] of one row's ids [T]: under tensor parallelism the table is split over
        the vocabulary and the result holds this rank's tokens of the sequence-parallel stream (a DTensor)."""
        table = self.embed_tokens.weight
        return sharded_embedding(ids, table) if isinstance(table, DTensor) else self.embed_tokens(ids)

    def row_context(self, x: Tensor, position_ids: Tensor, doc_lens: Tensor) -> tuple[Tensor, Tensor, DocumentMask]:
        """The rotary tables (in x's dtype) and the document mask of the row whose hidden states x [T, hidden] (or
        widened stream [n, T, hidden]) a block is about to read; a pipeline stage without the embedding builds them
        from its input this way."""
        mask = DocumentMask.from_doc_lens(doc_lens, x.device)
        tokens = x.shape[-2]
        if mask.total != tokens * self.row_split:
            raise ValueError(f"doc_lens add up to {mask.total}, which is not the {tokens} tokens of this row"
                             + ("" if self.row_split == 1 else f" x cp {self.row_split}"))  # fmt: skip
        cos, sin = rotary_cos_sin(position_ids, self.arch, x.dtype)
        windows = {layer.self_attn.window for layer in [*self.layers, *self.mtp_layers] if is_present(layer)}
        prepare_mask(self.attention, mask, windows)
        return cos, sin, mask

    def decode(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        """The blocks and the final norm on embeddings x [T, hidden] -> [T, hidden]."""
        rate = stream_rate(self.arch)
        if rate:
            x = expand_stream(x, rate)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        if rate:
            x = collapse_stream(x)
        return self.norm(x)

    def mtp_hidden(self, hidden: Tensor, input_ids: Tensor, targets: Tensor, cos: Tensor, sin: Tensor,
                   mask: DocumentMask) -> list[tuple[Tensor, Tensor]]:  # fmt: skip
        """Each MTP depth's normed hidden states [T, hidden] and targets [T] (`lmforge.model.mtp`), from the main
        model's final hidden states and the row's input_ids and targets [T]."""
        if self.row_split != 1:
            raise ValueError("multi-token prediction does not run under context parallelism")
        out, previous = [], hidden
        for depth, layer in enumerate(self.mtp_layers, start=1):
            ids, depth_targets = mtp_targets(input_ids, targets, mask.doc_ids, depth)
            previous = layer(previous, self.embed_tokens(ids), cos, sin, mask)
            out.append((previous, depth_targets))
        return out


class CausalLM(nn.Module):
    """A decoder with its LM head (HF's `*ForCausalLM` layout)."""

    def __init__(self, arch: AnyArch, vocab_size: int, attn_backend: str = "sdpa") -> None:
        super().__init__()
        self.arch = arch
        self.vocab_size = vocab_size
        self.attn_backend = attn_backend
        self.model = DecoderModel(arch, vocab_size, get_attention(attn_backend))
        self.lm_head = nn.Linear(arch.hidden_size, vocab_size, bias=False)
        # With targets, the LM head and loss run this many tokens at a time (0: all logits at once).
        self.loss_chunk_tokens = 0
        self.z_loss = 0.0
        """Coefficient of the z-loss (`model.z_loss`, set by the trainer; 0: none): a training forward's loss then
        has the gradient of CE + z_loss x the sum of lse^2 over its loss tokens, its value staying the CE."""
        self.z_sum: Tensor | None = None
        """While z_loss > 0, the last training forward's sum of lse^2 over the main head's loss tokens (fp32,
        detached, on the device), for the step's statistics (`lmforge.train.micro_batches`)."""
        depths = len(self.model.mtp_layers)
        # Multi-token prediction (`lmforge.model.mtp`): each depth's loss gradient, set per step by the trainer,
        # and the step's summed losses and targets per depth, read once per step.
        self.register_buffer("mtp_scale", torch.zeros(depths), persistent=False)
        self.register_buffer("mtp_loss_sum", torch.zeros(depths), persistent=False)
        self.register_buffer("mtp_tokens", torch.zeros(depths), persistent=False)
        self.tie_weights()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the multi-token-prediction buffers (the state of a fresh build; `lmforge.model.init.reset_buffers`)."""
        for buf in (self.mtp_scale, self.mtp_loss_sum, self.mtp_tokens):
            buf.zero_()

    def tie_weights(self) -> None:
        """Make the LM head use the embedding matrix when the architecture ties them (again after `to_empty`,
        which gives every module a parameter of its own)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks: the units of sharding, activation checkpointing and compilation (the MTP modules
        after the decoder's)."""
        return [layer for layer in [*self.model.layers, *self.model.mtp_layers] if is_present(layer)]

    def held_elsewhere(self, name: str) -> bool:
        """Whether parameter `name` of the whole model belongs to a part that another pipeline stage holds (an
        `AbsentLayer`, or the embedding, final norm or LM head where this rank has none)."""
        decoder = self.model
        parts = {"model.embed_tokens.": decoder.embed_tokens, "model.norm.": decoder.norm, "lm_head.": self.lm_head}
        if any(name.startswith(prefix) and part is None for prefix, part in parts.items()):
            return True
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return index < len(decoder.layers) and not is_present(decoder.layers[index])
        return False

    def moe_layers(self) -> dict[int, MoE]:
        """The MoE blocks by decoder-layer index, MTP modules numbered after the decoder's (empty for a dense
        model); under pipeline parallelism those of this rank's stages."""
        layers = enumerate([*self.model.layers, *self.model.mtp_layers])
        return {i: layer.mlp for i, layer in layers if is_present(layer) and isinstance(layer.mlp, MoE)}

    def reset_moe_stats(self) -> None:
        """Zero every MoE block's per-step statistics (`tokens_per_expert`, `routing_confidence_sum`)."""
        for moe in self.moe_layers().values():
            moe.reset_stats()

    def active_fractions(self) -> dict[str, float]:
        """Parameter name -> share of a token's compute it sees, for the parameters that are not fully active
        (routed experts: top_k / num_experts)."""
        return active_fractions(self)

    def param_counts(self) -> ParamCounts:
        """Total, embedding, non-embedding, active non-embedding and active matmul parameter counts."""
        return count_params(self)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_lens: Tensor,
        targets: Tensor | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """input_ids and position_ids [1, T], doc_lens [S] -> logits [1, T, vocab]; with targets [1, T]
        (IGNORE_INDEX where there is no loss), the fp32 sum of the token cross-entropies instead, or with
        `per_token` (scoring, no gradient) each position's fp32 cross-entropy [T]. The loss is computed inside
        forward so that FSDP sees the LM head used where it manages its parameters."""
        x, cos, sin, mask = self.model.inputs(input_ids, position_ids, doc_lens)
        hidden = self.model.decode(x, cos, sin, mask)
        if targets is None:
            logits = self.lm_head(hidden.unsqueeze(0))
            return logits.full_tensor() if isinstance(logits, DTensor) else logits
        if per_token:
            return head_position_losses(hidden, self.lm_head.weight, targets[0], self.loss_chunk_tokens)
        z_loss = self.z_loss if self.training else 0.0
        loss, self.z_sum = head_loss_and_z(hidden, self.lm_head.weight, targets[0], self.loss_chunk_tokens, z_loss)
        if not self.training or not len(self.model.mtp_layers):
            return loss
        # Multi-token prediction trains through its gradient alone: the returned loss stays the main model's. Each
        # depth's head has the z-loss too, scaled like that depth's cross-entropy.
        depths = self.model.mtp_hidden(hidden, input_ids[0], targets[0], cos, sin, mask)
        weight = self.lm_head.weight
        chunk = self.loss_chunk_tokens
        sums = torch.stack([head_cross_entropy(d, weight, t, chunk, z_loss=z_loss) for d, t in depths])
        with torch.no_grad():
            self.mtp_loss_sum.add_(sums.detach())
            self.mtp_tokens.add_(torch.stack([(t != IGNORE_INDEX).sum() for _, t in depths]).float())
        return with_aux_gradient(loss, sums, self.mtp_scale)
