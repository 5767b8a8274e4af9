"""Mixture-of-experts block: an fp32 router (with GLM-4.5's selection bias), routed experts stored as stacked 3-D
weights, and optional shared experts.

Names follow transformers 5 (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.experts.gate_up_proj`
[E, 2I, H] with the gate half first, `mlp.experts.down_proj` [E, H, I], `mlp.shared_experts.*`), so the state dict
equals that of `Glm4MoeForCausalLM` / `Qwen3MoeForCausalLM` in memory; `hf_names` maps it to the per-expert layout
of HF checkpoint files.

Routed experts run as two grouped matmuls over the token copies sorted by expert (no Python loop over experts, no
host sync on a CUDA device with the bf16 kernel, traceable by torch.compile), or through `Experts.impl = "loop"`, a
per-expert reference. Each block accumulates, on the device and in training mode only, the statistics the training
loop reads once per step: `tokens_per_expert`, `routing_confidence_sum` and, with the sequence-wise balance loss on,
`seq_aux_sum`.

The sequence-wise balance loss is `lmforge.model.seq_balance`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.config.arch_base import MoESpec
from lmforge.model.attention import DocumentMask
from lmforge.model.aux_loss import with_aux_gradient
from lmforge.model.dispatch import ExpertExchange, dispatch_order, inverse_permutation
from lmforge.model.grouped_mm import grouped_mm
from lmforge.model.mlp import MLP
from lmforge.model.seq_balance import TokenSplit, seq_balance_loss

ExpertsImpl = Literal["auto", "grouped_mm", "loop"]
"""How routed experts are computed: `grouped_mm` (`torch._grouped_mm`, see `lmforge.model.grouped_mm`), `loop` (the
reference: one matmul pair per expert, with the counts read on the host), `auto` (grouped_mm when torch has it and
the shapes meet its 16-byte alignment, else loop)."""


def sign_rule(tokens_per_expert: Tensor, coeff: float) -> Tensor:
    """DeepSeek-V3's change of a selection bias from the step's global token counts: +coeff for every expert that
    got fewer tokens than the mean, -coeff for the others (0 at the mean), in float32 on the counts' device."""
    counts = tokens_per_expert.to(torch.float32)
    return coeff * torch.sign(counts.mean() - counts)


def group_limited(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """DeepSeek-V3's group-limited selection: the experts' selection values choice [T, E] with every expert outside
    each token's topk_group best groups set to -inf, a group scoring the sum of its two highest values."""
    groups = choice.unflatten(-1, (n_group, -1))
    best = groups.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(-1, best, True)
    return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


@dataclass
class Routing:
    """The router's decision for T tokens."""

    weights: Tensor
    """fp32 [T, k]: gate value of each chosen expert."""
    indices: Tensor
    """int64 [T, k]: the chosen experts."""
    confidence: Tensor
    """fp32 [T]: share of the token's router score mass held by the chosen experts (k / E when uniform)."""
    scores: Tensor
    """fp32 [T, E]: the unbiased scores of every expert."""


class Router(nn.Module):
    """Scores experts in fp32 and picks the top k (HF's `gate`).

    With a selection bias (GLM-4.5), experts are chosen by score + `e_score_correction_bias`, while the gate values
    come from the unbiased scores: the bias steers load without changing what a chosen expert contributes.
    """

    def __init__(self, spec: MoESpec, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        # Null experts (indices num_experts and up) are scored and chosen like routed ones.
        choices = spec.num_experts + spec.null_experts
        self.weight = nn.Parameter(torch.empty(choices, hidden))
        # gpt-oss: a learned bias on the logits (trained by gradients, unlike the selection bias).
        self.bias = nn.Parameter(torch.empty(choices)) if spec.router_bias else None
        if spec.selection_bias:
            # Persistent: it is trained state (by the balancing rule, not by gradients) and HF checkpoints hold it.
            self.register_buffer("e_score_correction_bias", torch.zeros(choices), persistent=True)
        # The quantile balancing rule (lmforge.train.callbacks.balancing) has training forwards add a histogram
        # [choices, bins] of the values the bias is added to (scores, or logits with `bias_on_logits`) over
        # `choice_range` [lo, hi] (a device tensor, so a new range each step recompiles nothing); values outside fall
        # in the edge bins.
        self.record_choices = False
        self.register_buffer("choice_histogram", torch.zeros(choices, 0), persistent=False)
        self.register_buffer("choice_range", torch.tensor([0.0, 1.0]), persistent=False)

    def forward(self, x: Tensor) -> Routing:
        """x [T, hidden] -> the routing of its tokens."""
        spec = self.spec
        logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        scores = logits.sigmoid() if spec.score_func == "sigmoid" else logits.softmax(dim=-1)
        biased = logits if spec.bias_on_logits else scores
        if self.record_choices and self.training and _counting():
            self._record(biased.detach())
        choice = biased + self.e_score_correction_bias.float() if spec.selection_bias else scores
        if spec.n_group > 1:
            choice = group_limited(choice, spec.n_group, spec.topk_group)
        indices = choice.topk(spec.top_k, dim=-1).indices
        chosen = scores.gather(-1, indices)
        confidence = chosen.sum(-1) / scores.sum(-1)
        weights = chosen
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if spec.routed_scaling_factor != 1.0:
            weights = weights * spec.routed_scaling_factor
        return Routing(weights, indices, confidence, scores)

    @torch.no_grad()
    def update_selection_bias(self, tokens_per_expert: Tensor, coeff: float) -> Tensor:
        """DeepSeek-V3's sign rule: raise the bias of every expert that got fewer tokens than the mean by `coeff`,
        lower the others by as much. `tokens_per_expert` must be the step's global counts (the same on every
        rank, so every rank's bias stays equal). Returns the change applied."""
        if not self.spec.selection_bias:
            raise ValueError("this router has no selection bias to update (only GLM-4.5-style routers do)")
        delta = sign_rule(tokens_per_expert.to(self.e_score_correction_bias.device), coeff)
        self.e_score_correction_bias.add_(delta.to(self.e_score_correction_bias.dtype))
        return delta

    @torch.no_grad()
    def _record(self, values: Tensor) -> None:
        """Add the selection values [T, choices] to the histogram: on the device, by scatter_add_, no host read."""
        choices, bins = self.choice_histogram.shape
        lo, hi = self.choice_range[0], self.choice_range[1]
        index = ((values - lo) * (bins / (hi - lo))).floor().clamp_(0, bins - 1).long()
        index = index + torch.arange(choices, device=values.device) * bins
        flat = self.choice_histogram.view(-1)
        flat.scatter_add_(0, index.reshape(-1), torch.ones(index.numel(), device=flat.device, dtype=flat.dtype))

    @torch.no_grad()
    def start_recording(self, bins: int, lo: float, hi: float) -> None:
        """Record histograms of `bins` bins over [lo, hi] from the next training forward on, starting from zero
        (the quantile rule calls this before every step it records)."""
        choices = self.choice_histogram.shape[0]
        if self.choice_histogram.shape[1] != bins:
            self.choice_histogram = self.choice_histogram.new_zeros(choices, bins)
        self.choice_histogram.zero_()
        self.choice_range.copy_(torch.tensor([lo, hi]))
        self.record_choices = True

    @torch.no_grad()
    def set_bias(self, bias: Tensor) -> None:
        """Set the selection bias (the same values on every rank). A host tensor goes to a CUDA device from
        page-locked memory, asynchronously: a copy from pageable memory would make the host wait for the device."""
        target = self.e_score_correction_bias
        if bias.device.type == "cpu" and target.device.type == "cuda":
            bias = bias.pin_memory().to(target.device, non_blocking=True)
        target.copy_(bias)

    @torch.no_grad()
    def reset_bias(self) -> None:
        """Zero the selection bias (the state of a freshly initialized router)."""
        if self.spec.selection_bias:
            self.e_score_correction_bias.zero_()


ExpertGlu = Literal["swiglu", "situ_glu", "clamped_swiglu"]
"""The routed experts' gated activation (see `glu`)."""


def glu(gate: Tensor, up: Tensor, kind: ExpertGlu = "swiglu", betas: tuple[float, float] = (4.0, 25.0)) -> Tensor:
    """The gated activation of an expert from its gate and up halves: SwiGLU silu(g) x u; SiTU-GLU (Kimi K3)
    b1 tanh(g / b1) sigmoid(g) x b2 tanh(u / b2), whose soft caps bound each factor (computed in fp32); or gpt-oss's
    clamped SwiGLU with betas = (alpha, limit): g' = min(g, limit), u' = clamp(u, -limit, limit),
    (u' + 1) x g' sigmoid(alpha g') (in the input's dtype, as transformers computes it)."""
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "clamped_swiglu":
        alpha, limit = betas
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    b1, b2 = betas
    g, u = gate.float(), up.float()
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))).to(gate.dtype)


class Experts(nn.Module):
    """The routed experts' gated MLP weights, stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I]; H is the width of the copies they take, the hidden size or, with LatentMoE, the latent one.

    Under expert parallelism (`lmforge.parallel.experts`) the stacks hold only this rank's E / ep experts
    (`keep_experts`), and `forward` hands the sorted copies to the `exchange` passed in, which sends each to the rank
    holding its expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, null_experts: int = 0,
                 act: ExpertGlu = "swiglu", betas: tuple[float, float] = (4.0, 25.0),
                 bias: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.act: ExpertGlu = act
        """The gated activation (`glu`)."""
        self.betas = betas
        """The activation's constants: SiTU-GLU's soft caps, the clamped SwiGLU's (alpha, limit); unused by SwiGLU."""
        self.num_experts = num_experts
        """Routed experts of the block (all ranks together)."""
        self.null_experts = null_experts
        """Zero-computation choices besides them (indices num_experts and up): their copies are not computed and
        contribute zero."""
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # gpt-oss's expert biases [E, 2I] (gate half first, like the rows of gate_up_proj) and [E, H].
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.init_rules = {"gate_up_proj_bias": "zero", "down_proj_bias": "zero"} if bias else {}
        """Expert biases start at zero, like every bias."""
        self.impl: ExpertsImpl = "auto"
        self.expert_offset = 0
        """Global index of the first expert the stacks hold (0 unless expert parallelism keeps a block of them)."""
        self.exchange: ExpertExchange | None = None
        """Under expert parallelism: sends the copies to the ranks holding their experts and back (see
        `ExpertExchange`); None computes every copy here."""
        self.register_buffer("tokens_computed", torch.zeros(()), persistent=False)

    def keep_experts(self, start: int, count: int) -> None:
        """Keep only experts [start, start + count) in the stacks (before FSDP wraps the module; on the meta device
        the stacks just shrink)."""
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, nn.Parameter(old.detach()[start : start + count].clone(), old.requires_grad))
        self.expert_offset = start

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H], indices and fp32 weights [T, k] -> (gate-weighted sum of the chosen experts' outputs [T, H],
        int64 tokens per choice [E + null experts] routed by this rank); under expert parallelism the copies sent
        are rows of x, H wide."""
        t, k = indices.shape
        real = self.num_experts
        order, counts = dispatch_order(indices, real + self.null_experts)
        # Row j of the sorted copies is token order[j] // k; indexing (not index_select) keeps backward
        # deterministic on CUDA (index_put with accumulate sorts its indices).
        xs = x[order // k]
        null = (indices.reshape(-1)[order] >= real).unsqueeze(-1) if self.null_experts else None
        if null is not None:
            # Null copies sort last and are left out of the grouped matmuls, whose rows past the last group (and
            # their gradients) are undefined: selects on both sides keep them out of the output and of x's gradient.
            xs = torch.where(null, torch.zeros((), dtype=xs.dtype, device=xs.device), xs)
        routed = counts[:real]
        ys = self._compute(xs, routed) if self.exchange is None else self.exchange(xs, routed, self._compute)
        if null is not None:
            ys = torch.where(null, torch.zeros((), dtype=ys.dtype, device=ys.device), ys)
        # Back to (token, slot) order through the inverse permutation, then the gate-weighted sum over slots.
        y = ys[inverse_permutation(order)].view(t, k, x.shape[-1])
        return (y * weights.unsqueeze(-1)).sum(1).to(x.dtype), counts

    def _compute(self, xs: Tensor, counts: Tensor) -> Tensor:
        """The local experts on copies sorted by local expert, `counts` [E / ep] of them each; rows after the last
        group (null copies) come back undefined."""
        if self.training and _counting():
            with torch.no_grad():
                self.tokens_computed.add_(counts.sum())
        return self._grouped_mm(xs, counts) if self._use_grouped_mm(xs) else self._loop(xs, counts)

    def _use_grouped_mm(self, x: Tensor) -> bool:
        if self.impl == "loop":
            return False
        available = hasattr(torch, "_grouped_mm")
        # _grouped_mm wants 16-byte aligned row strides in every operand.
        align = 16 // x.element_size()
        aligned = x.shape[-1] % align == 0 and self.intermediate % align == 0 and x.dtype == self.down_proj.dtype
        if self.impl == "grouped_mm" and not (available and aligned):
            raise ValueError(
                f"experts impl grouped_mm needs torch._grouped_mm and hidden/intermediate sizes divisible by {align} "
                f"with matching dtypes (got x {tuple(x.shape)} {x.dtype}, weights {self.down_proj.dtype})"
            )
        return available and aligned

    def _grouped_mm(self, xs: Tensor, counts: Tensor) -> Tensor:
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offsets)
        row_expert = None
        if self.gate_up_proj_bias is not None:
            # Each sorted copy's local expert, found on the device from the group ends (no host read); rows past
            # the last group are clamped to it and come back undefined anyway.
            rows = torch.arange(xs.shape[0], device=xs.device, dtype=torch.int32)
            row_expert = torch.searchsorted(offsets, rows, right=True).clamp_(max=counts.shape[0] - 1)
            hidden = hidden + self.gate_up_proj_bias[row_expert].to(hidden.dtype)
        gate, up = hidden.chunk(2, dim=-1)
        out = grouped_mm(glu(gate, up, self.act, self.betas), self.down_proj.transpose(-2, -1), offsets)
        if self.down_proj_bias is not None and row_expert is not None:
            out = out + self.down_proj_bias[row_expert].to(out.dtype)
        return out

    def _loop(self, xs: Tensor, counts: Tensor) -> Tensor:
        # The per-expert reference reads the group sizes on the host: one device sync per MoE layer and forward on
        # CUDA. `auto` takes it only for sizes `_grouped_mm` cannot take (see `_use_grouped_mm`).
        outs = []
        sizes = counts.tolist()
        rest = xs.shape[0] - sum(sizes)  # null copies
        for e, chunk in enumerate(xs.split([*sizes, rest])):
            if e == len(sizes):
                outs.append(chunk.new_zeros(rest, self.down_proj.shape[1]))
                break
            gate_up_bias, down_bias = self.gate_up_proj_bias, self.down_proj_bias
            gate, up = F.linear(chunk, self.gate_up_proj[e], None if gate_up_bias is None else gate_up_bias[e]).chunk(
                2, dim=-1
            )
            outs.append(F.linear(glu(gate, up, self.act, self.betas), self.down_proj[e],
                                 None if down_bias is None else down_bias[e]))  # fmt: skip
        return torch.cat(outs)


def _counting() -> bool:
    """False while activation checkpointing recomputes a forward inside backward (eager), so the statistics count
    each token once. Compiled blocks apply buffer updates once per forward anyway, and the check cannot be traced."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1


class MoE(nn.Module):
    """Router, routed experts and optional shared experts: the MLP of an MoE decoder layer.

    With `spec.latent_size` (LatentMoE), the routed experts work in that width: `latent_down_proj` [latent, hidden]
    projects each token once before dispatch (so expert-parallel exchanges move latent rows) and `latent_up_proj`
    [hidden, latent] takes the gated sum of the experts' outputs back to the hidden size; the router and the shared
    experts read the hidden state itself. Nothing else sits in the latent path (no norm, no bias), and the routed
    scaling factor is part of the gate values, before the up projection.

    Training-mode forwards add to two fp32 device buffers (non-persistent: not in state dicts or checkpoints), which
    the training loop reads and zeroes once per step:

    - `tokens_per_expert` [E + null experts]: token copies routed to each expert, null ones last (sums to
      tokens x k);
    - `routing_confidence_sum` []: sum over tokens of `Routing.confidence`; divided by tokens_per_expert.sum() / k
      it is the mean routing confidence;
    - `experts.tokens_computed` []: token copies this rank's experts computed (under expert parallelism, those
      it received from its group; otherwise tokens_per_expert.sum()).
    """

    def __init__(self, spec: MoESpec, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Router(spec, hidden)
        width = spec.latent_size or hidden
        self.latent_down_proj = nn.Linear(hidden, width, bias=False) if spec.latent_size else None
        self.latent_up_proj = nn.Linear(width, hidden, bias=False) if spec.latent_size else None
        constants = spec.swiglu_clamp if spec.expert_glu == "clamped_swiglu" else spec.situ_betas
        self.experts = Experts(spec.num_experts, width, spec.intermediate_size, spec.null_experts, spec.expert_glu,
                               constants, spec.expert_bias)  # fmt: skip
        self.shared_experts = (
            MLP(hidden, spec.num_shared_experts * spec.intermediate_size) if spec.num_shared_experts else None
        )
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts + spec.null_experts), persistent=False)
        self.register_buffer("routing_confidence_sum", torch.zeros(()), persistent=False)
        self.register_buffer("seq_aux_sum", torch.zeros(()), persistent=False)
        self.register_buffer("aux_scale", torch.zeros(()), persistent=False)
        self.seq_aux = False
        """Add the sequence-wise balance loss in training (set by the trainer before the first forward)."""
        self.token_split: TokenSplit | None = None
        """Under context or tensor parallelism, which tokens of each row this block sees (the sequence-wise loss
        counts choices over the whole row)."""

    def forward(self, x: Tensor, mask: DocumentMask | None = None) -> Tensor:
        """x [T, hidden] -> [T, hidden]; `mask` gives the segments of the sequence-wise balance loss."""
        routing = self.gate(x)
        routed = self.latent_down_proj(x) if self.latent_down_proj is not None else x
        out, counts = self.experts(routed, routing.indices, routing.weights)
        if self.latent_up_proj is not None:
            out = self.latent_up_proj(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        aux = None
        if self.seq_aux and self.training and mask is not None:
            aux = seq_balance_loss(routing, mask.doc_ids, mask.cu_seqlens, self.spec.num_experts, self.token_split)
            out = with_aux_gradient(out, aux, self.aux_scale)
        if self.training and _counting():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
                self.routing_confidence_sum.add_(routing.confidence.sum())
                if aux is not None:
                    self.seq_aux_sum.add_(aux.detach())
        return out

    @torch.no_grad()
    def reset_stats(self) -> None:
        """Zero the per-step statistics."""
        self.tokens_per_expert.zero_()
        self.routing_confidence_sum.zero_()
        self.seq_aux_sum.zero_()
        self.experts.tokens_computed.zero_()

    def reset_buffers(self) -> None:
        """Zero every buffer: the statistics and the selection bias (the state of a fresh init)."""
        self.reset_stats()
        self.gate.reset_bias()
