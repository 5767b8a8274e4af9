"""One optimizer step of a config on rank 0 of a fake process group of N ranks, on fake tensors.

The model is built and sharded as `lmforge train` builds it on N GPUs (`build_run_model` with the CUDA device's
choices: its attention kernel, bf16 parameters under `auto`, its loss chunking), the optimizers as the run's,
and the step is the trainer's own forward/backward loop (`run_micro_batches`) and optimizer update, once to create
the optimizer state and once measured. Fake tensors have shapes, dtypes and devices but no storage, so any model
size runs on a CPU in seconds.

Measured on the second step: memory by category at its peak (torch's `FSDPMemTracker`, or `MemTracker` for a
model FSDP does not wrap), the operators' roofline (`lmforge.plan.roofline`) and the collectives
(`lmforge.plan.collectives`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from lmforge.config.train import TrainConfig
from lmforge.data.tokenizer import TokenizerError, TokenizerInfo, load_tokenizer
from lmforge.model import build_model
from lmforge.model.attention import describe_backend
from lmforge.model.completep import role_scales
from lmforge.optim import build_optimizer
from lmforge.parallel.context import shard_micro_batch
from lmforge.parallel.fsdp import fsdp_wraps, resolve_param_dtype
from lmforge.parallel.model_setup import build_pipelined_model, build_run_model
from lmforge.parallel.pipeline import Pipeline
from lmforge.parallel.process_group import DistContext, init_distributed, mesh_degrees
from lmforge.plan.attention import stand_in_for_flex
from lmforge.plan.batches import plan_batches
from lmforge.plan.collectives import IN_LINE, Collectives, Traffic
from lmforge.plan.experts import balance_dispatches
from lmforge.plan.gpus import GpuSpec
from lmforge.plan.muon import host_row_tables
from lmforge.plan.pipeline import PIPELINE_NOTE, held_layers, pipeline_bubble, pipeline_choice, static_shapes
from lmforge.plan.roofline import ATTENTION_OPS, Roofline
from lmforge.train.flops import FlopCounter
from lmforge.train.micro_batches import run_micro_batches, run_pipelined

CUDA = torch.device("cuda")
"""The device whose choices the plan makes (its tensors stay fake CPU tensors)."""
CPU = torch.device("cpu")
"""Where the fake tensors live."""

CATEGORIES = {
    "parameters": ("Sharded Param", "Unsharded Param", "Buffer", "Parameter"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Gradient"),
    "optimizer state": ("OptState", "Optstate"),
    "activations": ("Activation",),
    "temporaries": ("Temp", "All Gather", "Reduce Scatter", "Inputs", "Input"),
}
"""The plan's memory categories and the tracker categories each one sums (FSDPMemTracker's and MemTracker's)."""


@dataclass
class AssumedVocabulary:
    """Stands in for a tokenizer that is not at hand: all the model build reads of one is its size."""

    size: int
    """Token ids."""


@dataclass
class Tally:
    """The roofline's and the collectives' counts at one point of the traced step (differences give a phase's)."""

    seconds: float
    """Roofline time."""
    flops: float
    """FLOPs torch's formulas counted."""
    uncounted: Counter[str]
    """Calls without a FLOP formula, by operator."""
    traffic: dict[str, Traffic]
    """Collectives by kind."""

    @classmethod
    def of(cls, roofline: Roofline, comms: Collectives) -> Tally:
        """The counts so far."""
        return cls(roofline.seconds, roofline.flops, Counter(roofline.uncounted), comms.snapshot())

    def _combine(self, other: Tally, sign: int) -> Tally:
        kinds = self.traffic.keys() | other.traffic.keys()
        traffic = {k: self.traffic.get(k, Traffic()) + other.traffic.get(k, Traffic()).times(sign) for k in kinds}
        uncounted = Counter(self.uncounted)
        uncounted.update({k: sign * v for k, v in other.uncounted.items()})
        return Tally(self.seconds + sign * other.seconds, self.flops + sign * other.flops, +uncounted,
                     {k: t for k, t in traffic.items() if t.calls})  # fmt: skip

    def __add__(self, other: Tally) -> Tally:
        return self._combine(other, 1)

    def __sub__(self, other: Tally) -> Tally:
        return self._combine(other, -1)

    def times(self, n: int) -> Tally:
        """These counts `n` times over."""
        return Tally(self.seconds * n, self.flops * n, Counter({k: v * n for k, v in self.uncounted.items()}),
                     {k: t.times(n) for k, t in self.traffic.items()})  # fmt: skip


@dataclass
class StepPlan:
    """What one step costs rank 0 of the target world."""

    memory: dict[str, float]
    """Category -> bytes at the step's peak (`CATEGORIES`, plus `other` for anything the tracker names otherwise);
    empty when this torch has no memory tracker (a note says so)."""
    peak_bytes: float
    """Total bytes at the peak (0 without a tracker)."""
    tokens: int
    """Tokens this rank computes per step (its share of each row under context parallelism)."""
    flops: float
    """This rank's training FLOPs per step by lmforge's counter (`lmforge.train.flops`)."""
    dense_flops: float
    """Its 6 x N x tokens part."""
    traced_flops: float
    """FLOPs torch's formulas counted on the traced forward and backward passes (attention aside)."""
    optimizer_flops: float
    """FLOPs of the optimizer update (Muon's Newton-Schulz iterations), which MFU leaves out."""
    compute_seconds: float
    """Roofline time of the operators, attention by formula where torch cannot count it."""
    comms: dict[str, Traffic]
    """Collective kind -> traffic of this rank."""
    comm_seconds: float
    """Time of the collectives, one after the other."""
    micro_batches: int
    """Micro-batches per step on this rank."""
    batches_source: str
    """Where the document lengths came from."""
    choices: dict[str, str]
    """The CUDA choices the plan made (attention kernel, parameter dtype, loss, checkpointing, FP8, compile)."""
    notes: list[str] = field(default_factory=list)
    """What the plan counted by formula or could not give."""
    in_line_seconds: float = 0.0
    """Of those, the tensor-parallel collectives' time (kinds ending in `IN_LINE`): between operators, not
    overlapped."""
    bubble: float = 0.0
    """Under pipeline parallelism, the schedule's idle share of the step in theory (`schedule_bubble`)."""
    held_layers: str = ""
    """Under pipeline parallelism, the decoder layers of this rank's stages, e.g. `layers 0-3, layers 8-11`."""
    pipeline_ranks: list[dict[str, Any]] = field(default_factory=list)
    """Under pipeline parallelism, every pipeline rank's figures (`lmforge.plan.ranks`); this plan is the rank
    with the highest peak."""

    @property
    def busy_seconds(self) -> float:
        """This rank's work in a step: compute, with the collectives overlapped behind it (FSDP prefetches), plus the
        tensor-parallel collectives, which wait for the operators before them and hold up the ones after."""
        return max(self.compute_seconds, self.comm_seconds - self.in_line_seconds) + self.in_line_seconds

    @property
    def step_seconds(self) -> float:
        """Estimated step time: the busy time, over the share of the step a pipeline schedule keeps the rank busy
        (the slowest pipeline rank's when `pipeline_ranks` are planned)."""
        own = self.busy_seconds / (1 - self.bubble)
        return max([own, *(r["step_seconds"] for r in self.pipeline_ranks)])


def plan_tokenizer(config: TrainConfig, vocab_size: int | None) -> tuple[TokenizerInfo | None, str | None]:
    """The run's tokenizer, or a stand-in (with a note) when it is not at hand or `vocab_size` is given: of
    `vocab_size` ids, else a pretrained model's own vocabulary, else 32,000."""
    name = config.tokenizer.name
    if vocab_size is None and name:
        try:
            return load_tokenizer(name), None
        except TokenizerError as e:
            why = f"{e}; set --vocab-size"
    elif vocab_size is None:
        return None, None
    else:
        why = "--vocab-size"
    if vocab_size is None and config.model.name is not None:
        from lmforge.config.hf_config import read_hf_config

        vocab, why = read_hf_config(Path(config.model.name)).vocab_size, f"model.name's; {why}"
    else:
        vocab = vocab_size or 32000
    return cast(TokenizerInfo, AssumedVocabulary(vocab)), f"vocabulary: {vocab:,} token ids assumed ({why})"


MEMORY_TRACKERS = ("torch.distributed._tools.fsdp2_mem_tracker", "torch.distributed._tools.mem_tracker")
"""torch's private memory trackers the plan's memory figures come from."""


def _tracker(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], notes: list[str]) -> Any:
    """torch's memory tracker for `model` and its optimizers; None, with a note, when this torch lacks it (the
    plan then gives every figure but memory)."""
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
    except (ImportError, AttributeError) as e:
        notes.append(f"memory not given: this torch {torch.__version__} lacks the memory trackers of "
                     f"{' / '.join(MEMORY_TRACKERS)} ({e}); whether the step fits is not checked")  # fmt: skip
        return None
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizers[0])
        tracker.track_external(*optimizers[1:])
    else:
        tracker = MemTracker()
        tracker.track_external(model, *optimizers)
    return tracker


def _categories(snapshot: dict[str, int]) -> dict[str, float]:
    memory = {name: float(sum(snapshot.get(k, 0) for k in keys)) for name, keys in CATEGORIES.items()}
    known = {k for keys in CATEGORIES.values() for k in keys} | {"Total"}
    memory["other"] = float(sum(v for k, v in snapshot.items() if k not in known))
    return memory


def fake_world(config: TrainConfig, world_size: int, mesh_device: str = "cpu", rank: int = 0) -> DistContext:
    """Rank `rank` of a fake process group of `world_size` ranks, with the run's device meshes on `mesh_device`."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise ValueError(f"this torch {torch.__version__} has no fake process group "
                         f"(torch.testing._internal.distributed.fake_pg: {e}); planning needs one") from e  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return init_distributed(mesh_device=mesh_device, **mesh_degrees(config.parallel))


@contextlib.contextmanager
def real_meshes() -> Iterator[None]:
    """Within the block, device meshes are made on real tensors. FSDP2 joins the data- and tensor-parallel meshes
    when it wraps a tensor-parallel model, and a new mesh finds this rank's coordinates with a data-dependent op
    (`nonzero`) that fake tensors cannot run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return original(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)  # type: ignore[method-assign,assignment]


def plan_step(
    config: TrainConfig,
    world_size: int,
    gpu: GpuSpec,
    gpus_per_node: int,
    doc_len: float | None = None,
    vocab_size: int | None = None,
    target: torch.device = CUDA,
    fake: bool = True,
    rank: int = 0,
) -> StepPlan:
    """Build the run's model on rank `rank` of `world_size` fake ranks and trace one optimizer step (see the
    module). `target` is the device whose choices the model takes. With `fake` False the same step runs on real CPU
    tensors (uninitialized weights, one rank): what the plan's memory figures are tested against. Under pipeline
    parallelism the rank runs its stages through the run's schedule (`lmforge.plan.pipeline`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    notes: list[str] = []
    compiled = config.model.compile
    # Compiling under fake tensors would trace every block for nothing: the plan runs the eager step.
    config = config.model_copy(update={"model": config.model.model_copy(update={"compile": False})})
    tokenizer, vocab_note = plan_tokenizer(config, vocab_size)
    if vocab_note:
        notes.append(vocab_note)
    ctx = fake_world(config, world_size, rank=rank)
    pipeline: Pipeline | None = None
    # read outside fake tensors: a mesh's rank table is a tensor
    tp_ranks = frozenset(ctx.tp.mesh.mesh.flatten().tolist()) if ctx.tp.mesh is not None else frozenset()
    try:
        batches = plan_batches(config, None if vocab_note else tokenizer, ctx.dp_size, doc_len)
        rows = batches.micro_batches
        micro_batches = [shard_micro_batch(mb, ctx.cp) for mb in rows]
        arch = config.model.arch
        assert arch is not None, "model.arch is filled in from model.name when the config is loaded"
        defer = config.model.defer_grad_sync
        unwrapped = fake and ctx.pp.size == 1 and not fsdp_wraps(config.model, ctx, target)
        if unwrapped:
            # A model FSDP does not wrap (float32 on one GPU) is given storage by `to_empty`, which cannot swap out
            # parameters made under fake tensors: build it on the meta device first, outside them.
            model = build_run_model(config, tokenizer, dataclasses.replace(ctx, device=torch.device("meta")), target)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), real_meshes():
            if unwrapped:
                model.to_empty(device=CPU)
                model.tie_weights()
            elif ctx.pp.size > 1:
                model, pipeline = build_pipelined_model(config, tokenizer, ctx, target)
                static_shapes(pipeline)
            else:
                model = build_run_model(config, tokenizer, ctx, target=target)
            flex = stand_in_for_flex(model)
            if flex:
                notes.append(
                    "flex attention has no backward on CPU tensors: the plan keeps what its kernel keeps "
                    "for backward (q, k, v, the output, the log-sum-exp) and counts its FLOPs by formula"
                )
            if balance_dispatches(model):
                notes.append("expert parallelism: every all-to-all sized as perfectly balanced routing would")
            init = config.model.init
            scale = role_scales(arch, init.scheme, init.base_hidden_size, init.base_num_layers)
            optimizer = build_optimizer(model, config.optim, scale, config.schedule, config.max_steps)
            host_row_tables(optimizer.optimizers)
            # The first step creates the optimizer state; the second, measured, is what every later step costs.
            # A pipeline schedule runs the step's every micro-batch, each through this rank's stages.
            _step(model, optimizer, micro_batches if pipeline else micro_batches[:1], defer, pipeline)
            tracker = _tracker(model, optimizer.optimizers, notes)
            roofline, comms = Roofline(gpu), Collectives(gpu, gpus_per_node, tp_ranks)
            marks: list[Tally] = []
            # The rank's first and last micro-batches stand for all: the middle ones repeat the first (same shapes,
            # and with `defer_grad_sync` the same missing reduction), and only the last reduce-scatters then.
            traced = [micro_batches[0], micro_batches[-1]] if len(micro_batches) > 1 else micro_batches
            mark = lambda first: _mark(marks, roofline, comms, None if first else tracker)  # noqa: E731
            if pipeline is not None:
                # torch's trackers follow one forward per module: their statistics restart at each stage forward
                mark = lambda first: None if first or tracker is None else tracker.reset_mod_stats()  # noqa: E731
            forwards = pipeline.modules if pipeline is not None else [model]
            with _before_each_forward(forwards, mark), tracker or contextlib.nullcontext(), roofline, comms:
                _mark(marks, roofline, comms)
                if pipeline is None:
                    run_micro_batches(model, traced, CPU, defer)
                else:
                    run_pipelined(pipeline, micro_batches, CPU)
                _mark(marks, roofline, comms)
                _update(optimizer)
                _mark(marks, roofline, comms)
            snapshot = tracker.get_tracker_snapshot("peak") if tracker is not None else {}
        # Phases: the step's loss-token count, each traced micro-batch, the update.
        phases = [b - a for a, b in itertools.pairwise(marks)]
        if pipeline is not None:
            update = phases[1]
            # Every micro-batch traced: torch's stages hold buffers per micro-batch of the step, so the peak grows
            # with their number beyond the schedule's in-flight activations.
            step = phases[0] + update
        elif len(micro_batches) > 1:
            prelude, first, last, update = phases
            step = prelude + first.times(len(micro_batches) - 1) + last + update
            notes.append(f"traced the first and last of the {len(micro_batches)} micro-batches; the step's time and "
                         "collectives count the first once for every micro-batch but the last")  # fmt: skip
        else:
            update = phases[2]
            step = phases[0] + phases[1] + update
        memory = _categories(next(iter(snapshot.values()), {})) if tracker is not None else {}
        windows = [arch.attention_window(i) for i in range(arch.num_hidden_layers)]
        # Under pipeline parallelism the FLOPs are the whole model's, each GPU's share 1 / pp of them.
        whole = model if pipeline is None else build_model(arch, model.vocab_size, config.model.attn, target, meta=True)
        counter = FlopCounter(whole, arch.num_hidden_layers, arch.num_attention_heads, arch.dim_per_head, windows,
                              arch.value_head_dim)  # fmt: skip
        # A TP group trains on the same rows, and so does a pipeline group: each GPU's share is 1 / (tp x pp) of
        # their tokens and of the model's FLOPs.
        split = ctx.tp.size * ctx.pp.size
        tokens = sum(mb.tokens for mb in rows) // ctx.cp.size // split
        pairs = counter.pairs([mb.doc_lens for mb in rows]) / ctx.cp.size / split
        flops, dense = counter.step_flops(tokens, pairs)
        compute = step.seconds
        formula = sorted(n for n in step.uncounted if n in ATTENTION_OPS) + (["flex_attention"] if flex else [])
        if formula:
            compute += (flops - dense) / gpu.peak_flops
            notes.append(f"attention ({', '.join(formula)}): FLOPs by lmforge's formula over the attended pairs "
                         "(torch's formula needs the sequence offsets, which fake tensors do not hold)")  # fmt: skip
        other = Counter({n: c for n, c in step.uncounted.items() if n not in ATTENTION_OPS})
        if other:
            notes.append(f"not counted in the time (no FLOP formula on fake tensors): {dict(other)}")
        if comms.unknown:
            notes.append(f"{comms.unknown} collectives whose size this torch's fake_collectives cannot give")
        choices = {
            "attention": describe_backend(model.attn_backend, target),
            "parameters": str(resolve_param_dtype(config.model.param_dtype, target)).removeprefix("torch."),
            "loss": f"chunks of {model.loss_chunk_tokens} tokens" if model.loss_chunk_tokens else "full logits",
            "activation checkpointing": config.model.ac.mode
            + (f" (every {config.model.ac.freq} blocks)" if config.model.ac.mode != "none" else ""),
            "fp8": config.model.fp8,
            "compile": "on (planned eager)" if compiled else "off",
            "layout": ctx.describe_layout(),
        }
        bubble, held = 0.0, ""
        if pipeline is not None:
            bubble, held = pipeline_bubble(config.parallel, len(rows)), held_layers(pipeline)
            choices["pipeline"] = pipeline_choice(config.parallel, ctx.pp.rank, held, bubble)
            notes.append(PIPELINE_NOTE)
        return StepPlan(
            memory=memory, peak_bytes=sum(memory.values()), tokens=tokens, flops=flops, dense_flops=dense,
            traced_flops=step.flops - update.flops, optimizer_flops=update.flops, compute_seconds=compute,
            comms=step.traffic,
            comm_seconds=sum(t.seconds for t in step.traffic.values()),
            in_line_seconds=sum(t.seconds for kind, t in step.traffic.items() if kind.endswith(IN_LINE)),
            micro_batches=len(rows),
            batches_source=batches.source,
            choices=choices, notes=notes, bubble=bubble, held_layers=held,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def _step(
    model: torch.nn.Module, optimizer: Any, micro_batches: list[Any], defer: bool, pipeline: Pipeline | None = None
) -> None:
    """The trainer's step without its host reads: forward/backward (through `pipeline`'s schedule under pipeline
    parallelism), then the update."""
    if pipeline is None:
        run_micro_batches(model, micro_batches, CPU, defer)
    else:
        run_pipelined(pipeline, micro_batches, CPU)
    _update(optimizer)


def _update(optimizer: Any) -> None:
    """Gradient norms, the clipped update and freeing the gradients, as the trainer's step does them (with the
    step's reduction replaced by fixed norms: nothing is read on the host)."""
    squares = optimizer.grad_squares(CPU)
    optimizer.update(1, dict.fromkeys(squares, 1.0), True)
    optimizer.zero_grad(set_to_none=True)


def _mark(marks: list[Tally], roofline: Roofline, comms: Collectives, tracker: Any = None) -> None:
    """Note the counts so far; with `tracker`, clear its per-module statistics first (torch's trackers follow one
    forward per module; the step's peak, which the plan reads, is kept)."""
    if tracker is not None:
        tracker.reset_mod_stats()
    marks.append(Tally.of(roofline, comms))


@contextlib.contextmanager
def _before_each_forward(models: Sequence[torch.nn.Module], call: Callable[[bool], Any]) -> Iterator[None]:
    """Within this block, run `call(first)` before every forward of any of `models` (`first` on the first one). A
    global hook, entered before the tracker's: it runs before the hooks the trackers add, module or global."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    calls = [0]
    watched = {id(m) for m in models}

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        if id(module) in watched:
            calls[0] += 1
            call(calls[0] == 1)

    handle = register_module_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()
