"""Pipeline parallelism: the model cut into stages over the ranks of a pipeline group, trained by a schedule of
`torch.distributed.pipelining`.

Every rank keeps the model's module tree with only its stages' parts in it: the decoder layers of other stages
are `AbsentLayer`s and the embedding, final norm and LM head are None where another stage holds them. Names,
and so checkpoints, optimizer groups and exports, stay those of the whole model: a checkpoint saved at any pp
loads at any other (`lmforge.checkpoint`).

A stage module (`StageModule`) runs its layers on one packed row. The rows' segment lengths and positions are not
sent between stages: every rank of a pipeline group holds the same micro-batches (they are dealt per data-parallel
rank), so each stage reads micro-batch i's from its own copy, `PipelineStage.forward_one_chunk` saying which i it
runs. The last stage returns the fp32 sum of its row's token losses; the schedule's loss function divides it by
the step's global loss-token count, known before the step, so the gradients are those of the step's token mean
without any rescaling (`scale_grads=False`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard

from lmforge.config.arch import AnyArch
from lmforge.config.parallel import ParallelConfig
from lmforge.data.batch import MicroBatch
from lmforge.model.hyper_connections import collapse_stream, expand_stream, stream_rate
from lmforge.model.llama import AbsentLayer, CausalLM, head_loss, head_position_losses
from lmforge.model.loss import IGNORE_INDEX
from lmforge.model.params import count_params
from lmforge.parallel.stages import PipeShard, balanced_split, stage_layers, stage_ranks, stages_per_rank
from lmforge.parallel.tensor import NO_TENSOR_PARALLEL, TOKENS, TensorShard

SCHEDULES: dict[str, Any] = {
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
"""`parallel.pp_schedule` -> its torch schedule class."""


class StageModule(nn.Module):
    """One pipeline stage of a `CausalLM`: the embedding (first stage), a contiguous run of decoder layers, and the
    final norm, LM head and loss (last stage). Its modules are the model's own (shared, not copied)."""

    def __init__(self, model: CausalLM, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        decoder = model.model
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList(decoder.layers[i] for i in layers)
        self.norm = decoder.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.layer_indices = layers
        """The decoder-layer indices this stage runs."""
        self._model = (model,)  # a tuple: the model is not a submodule (its other stages are not this one's)
        self.rows: Sequence[MicroBatch] = ()
        """The step's micro-batches (on the device), set by `Pipeline.step`."""
        self.current = 0
        """Which of `rows` the next forward runs (set by the pipeline stage before each forward)."""
        self.loss_sums: list[Tensor] = []
        """The last stage's loss sums of the step, one per micro-batch in order."""
        self.stream_mesh: DeviceMesh | None = None
        """Under tensor parallelism, the TP mesh whose sequence-parallel stream this stage's input is this rank's
        share of (its tokens): hidden states cross stages as each rank's local tokens."""

    def forward(self, x: Tensor, per_token: bool = False) -> Tensor:
        """input_ids [1, T] (first stage) or the previous stage's hidden states [T, hidden] (with hyper-connections
        the widened stream [n, T, hidden]) -> this stage's hidden states, or on the last stage the fp32 sum of the
        row's token cross-entropies (with `per_token`, for scoring without gradients, each position's [T])."""
        mb = self.rows[self.current]
        model = self._model[0]
        rate = stream_rate(model.arch)
        first = self.embed_tokens is not None
        if first:
            x = model.model.embed(x[0])
        else:
            x = _ContiguousGrad.apply(x)
            if self.stream_mesh is not None:
                # the tokens are dim 0 of [T, hidden] and dim 1 of the widened stream [n, T, hidden]
                x = DTensor.from_local(x, self.stream_mesh, [Shard(1) if rate else TOKENS])
        cos, sin, mask = model.model.row_context(x, mb.position_ids, mb.doc_lens)
        if rate and first:
            x = expand_stream(x, rate)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        if self.lm_head is None:
            # Under tensor parallelism each rank sends its own tokens of the stream to its peer in the next stage, as
            # a tensor of its own: the zero-bubble schedules detach stage outputs in place, which a view refuses.
            return x.to_local().clone() if isinstance(x, DTensor) else x
        assert self.norm is not None
        if rate:
            x = collapse_stream(x)
        targets = mb.target_ids[0].masked_fill(~mb.loss_mask[0], IGNORE_INDEX)
        hidden, chunk = self.norm(x), model.loss_chunk_tokens
        if per_token:
            return head_position_losses(hidden, self.lm_head.weight, targets, chunk)
        loss = head_loss(hidden, self.lm_head.weight, targets, chunk)
        self.loss_sums.append(loss.detach())
        return loss


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: a stage's input gradient is sent back to the
    previous stage, and a send refuses a strided tensor (the hyper-connections' einsum leaves one)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        """x, as a view."""
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        """The gradient, contiguous."""
        return grad.contiguous()


class RowStage(PipelineStage):
    """A `PipelineStage` that tells its `StageModule` which micro-batch each forward runs (schedules run a stage's
    forwards in micro-batch order, but the index is given, so nothing depends on it)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """Run micro-batch `fwd_chunk_id` through this stage."""
        self.submod.current = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


def stage_sizes(model: CausalLM, parallel: ParallelConfig) -> list[int]:
    """Decoder layers per stage: `parallel.pp_layers`, else balanced by compute: each layer weighs its active
    matmul parameters (a token's forward FLOPs / 2; routed experts at top_k / experts) and the last stage also
    the LM head's. The embedding is a lookup: it weighs nothing, though the first stage holds it."""
    if parallel.pp_layers is not None:
        return list(parallel.pp_layers)
    stages = parallel.pp * stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    decoder = model.model
    weights = [float(count_params(layer).active_matmul) for layer in decoder.layers]
    return balanced_split(weights, stages, last=float(model.lm_head.weight.numel()))


def stage_owners(parallel: ParallelConfig, pp: PipeShard) -> tuple[list[int], list[int]]:
    """The pipeline rank of every stage (first stage first), and the stages this rank holds."""
    owners = stage_ranks(pp.size, stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank),
                         parallel.pp_schedule)  # fmt: skip
    return owners, [s for s, owner in enumerate(owners) if owner == pp.rank]


def split_stages(model: CausalLM, parallel: ParallelConfig, pp: PipeShard) -> list[StageModule]:
    """Cut a freshly built model (on the meta device) into this rank's stages, in place: the layers, embedding and
    head of other ranks' stages leave the model. Returns this rank's stage modules, first stage first."""
    layers = stage_layers(stage_sizes(model, parallel))
    owners, mine = stage_owners(parallel, pp)
    last = len(owners) - 1
    modules = [StageModule(model, layers[s], s == 0, s == last) for s in mine]
    held = {i for s in mine for i in layers[s]}
    decoder = model.model
    for i in range(len(decoder.layers)):
        if i not in held:
            decoder.layers[i] = AbsentLayer()
    if 0 not in mine:
        decoder.embed_tokens = None  # type: ignore[assignment]
    if last not in mine:
        decoder.norm = None  # type: ignore[assignment]
        model.lm_head = None  # type: ignore[assignment]
    return modules


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through them."""

    stages: list[RowStage]
    """This rank's pipeline stages, lowest stage index first."""
    modules: list[StageModule]
    """Their modules (FSDP roots of their own)."""
    schedule: Any
    """The `torch.distributed.pipelining` schedule."""
    pp: PipeShard
    """This rank's pipeline group."""
    owners: list[int]
    """The pipeline rank of every stage, first stage first."""
    dtype: torch.dtype
    """The hidden states' dtype between stages."""
    denominator: list[Tensor] = field(default_factory=list)
    """The current step's global loss-token count (one element), read by the loss function."""

    @property
    def holds_first(self) -> bool:
        """Whether this rank runs the first stage (takes the input ids)."""
        return any(s.is_first for s in self.stages)

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the last stage (computes the losses)."""
        return any(s.is_last for s in self.stages)

    def step(self, micro_batches: Sequence[MicroBatch], denominator: Tensor) -> list[Tensor]:
        """Forward and backward of the step's micro-batches (on the device) through every stage: gradients of
        `sum of token losses / denominator` accumulate in this rank's stages. Returns the last stage's loss sums,
        one per micro-batch (empty on other ranks)."""
        self.denominator[:] = [denominator]
        for module in self.modules:
            module.rows, module.loss_sums = micro_batches, []
        n = len(micro_batches)
        args = (torch.cat([mb.input_ids for mb in micro_batches]),) if self.holds_first else ()
        # The loss function ignores its target: the last stage reads its rows' targets itself. The schedule still
        # needs one target per micro-batch to call it.
        target = torch.zeros(n, device=denominator.device) if self.holds_last else None
        self.schedule.step(*args, target=target, return_outputs=False)
        last = next((m for m in self.modules if m.lm_head is not None), None)
        sums = list(last.loss_sums) if last is not None else []
        for module in self.modules:
            module.rows, module.loss_sums = (), []
        return sums

    @torch.no_grad()
    def score(self, mb: MicroBatch, per_token: bool) -> Tensor:
        """Forward only, one row through every stage in order (each rank runs its stages, receiving and sending the
        hidden states point to point): the row's fp32 loss sum (or with `per_token` its per-position losses [T])
        on the rank holding the last stage, zeros of the same shape on the others. Every rank of the pipeline
        group calls it for the same row."""
        tokens = mb.input_ids.shape[1]
        held = [s for s, owner in enumerate(self.owners) if owner == self.pp.rank]
        mine = dict(zip(held, self.modules, strict=True))
        x: Tensor = mb.input_ids
        last = len(self.owners) - 1
        out = torch.zeros(tokens if per_token else (), device=mb.input_ids.device)
        for stage, module in mine.items():
            if stage > 0 and self.owners[stage - 1] != self.pp.rank:
                shape = stream_shape(self.modules[0]._model[0].arch, tokens // self.stream_split)
                x = torch.empty(shape, dtype=self.dtype, device=mb.input_ids.device)
                dist.recv(x, group=self.pp.group, group_src=self.owners[stage - 1])
            module.rows, module.current = (mb,), 0
            x = module(x, per_token=per_token)
            module.rows, module.loss_sums = (), []
            if stage == last:
                out = x
            elif self.owners[stage + 1] != self.pp.rank:
                dist.send(x.contiguous(), group=self.pp.group, group_dst=self.owners[stage + 1])
        return out

    @property
    def stream_split(self) -> int:
        """Ranks each row's hidden states are split over between stages: `parallel.tp` (sequence parallel)."""
        mesh = self.modules[0].stream_mesh
        return 1 if mesh is None else mesh.size()


def stream_shape(arch: AnyArch, tokens: int) -> tuple[int, ...]:
    """The shape of `tokens` tokens of a row's hidden states as they cross stages: [T, hidden], or with
    hyper-connections the widened residual stream [n, T, hidden] (its copies are summed on the last stage)."""
    rate = stream_rate(arch)
    return (rate, tokens, arch.hidden_size) if rate else (tokens, arch.hidden_size)


def build_pipeline(
    modules: list[StageModule],
    pp: PipeShard,
    parallel: ParallelConfig,
    micro_batches: int,
    row_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorShard = NO_TENSOR_PARALLEL,
) -> Pipeline:
    """The pipeline stages and schedule of this rank's (sharded, materialized) stage modules, for steps of
    `micro_batches` rows of `row_tokens` tokens, the hidden states between stages in `dtype`. Under tensor
    parallelism (`tp`) each rank sends and receives its row_tokens / tp tokens of the sequence-parallel stream."""
    owners, mine = stage_owners(parallel, pp)
    stages = []
    # Hidden states cross stages with their gradient coming back.
    arch = modules[0]._model[0].arch
    hidden = torch.empty(stream_shape(arch, row_tokens // tp.size), dtype=dtype, device="meta", requires_grad=True)
    for index, module in zip(mine, modules, strict=True):
        module.stream_mesh = tp.mesh
        first, last = index == 0, index == len(owners) - 1
        inputs = torch.empty(1, row_tokens, dtype=torch.int64, device="meta") if first else hidden
        outputs = torch.empty((), dtype=torch.float32, device="meta") if last else hidden
        stages.append(RowStage(module, index, len(owners), device, input_args=inputs, output_args=outputs,
                               group=pp.group))  # fmt: skip
    pipeline = Pipeline(stages, modules, None, pp, owners, dtype)

    def loss_fn(loss_sum: Tensor, _target: Tensor) -> Tensor:
        return loss_sum / pipeline.denominator[0]

    kind = SCHEDULES[parallel.pp_schedule]
    chosen = stages[0] if kind is Schedule1F1B else stages
    pipeline.schedule = kind(chosen, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return pipeline


class PipelineScorer(nn.Module):
    """The model as validation and scoring call it (`CausalLM.forward` with targets), run forward only through the
    pipeline (`Pipeline.score`): the loss sums or per-position losses on the rank that computes the loss, zeros on
    the others, which count nothing (`DistContext.counts_tokens`)."""

    def __init__(self, pipeline: Pipeline, model: CausalLM) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.stages = nn.ModuleList(pipeline.modules)  # so that train() and eval() reach every stage
        self._model = (model,)

    @property
    def loss_chunk_tokens(self) -> int:
        """The model's loss chunking, which the last stage uses."""
        return self._model[0].loss_chunk_tokens

    @loss_chunk_tokens.setter
    def loss_chunk_tokens(self, value: int) -> None:
        self._model[0].loss_chunk_tokens = value

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_lens: Tensor,
        targets: Tensor | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """As `CausalLM.forward` with targets: the row's fp32 loss sum, or with `per_token` each position's loss."""
        if targets is None:
            raise ValueError("under pipeline parallelism the model scores rows against targets; logits stay on the "
                             "last stage")  # fmt: skip
        loss_mask = targets != IGNORE_INDEX
        mb = MicroBatch(input_ids=input_ids, target_ids=targets.clamp_min(0), position_ids=position_ids,
                        loss_mask=loss_mask, doc_lens=doc_lens)  # fmt: skip
        return self.pipeline.score(mb, per_token)
