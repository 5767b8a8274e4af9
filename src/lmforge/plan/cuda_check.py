"""`lmforge plan --check-cuda`: run a config's CUDA training step on fake CUDA tensors, on a machine without a GPU.

Fake tensors carry a device, a dtype and a shape but no storage. With the CUDA build of torch installed (a GPU is
not needed: a cluster's login node will do), every kernel of the step checks its inputs as it would on the GPU,
so a tensor left on the CPU, a dtype the kernel refuses or a shape that only the target world size produces fails
here, not after hours in a queue. The step is rank 0's of the target world, on a fake process group:

- the model as `lmforge train` builds it for that world (attention kernel, parameter dtype, loss, FP8, context and
  expert parallelism), on fake CUDA tensors. FSDP is left out (it needs CUDA streams), and the parameters are cast
  to the dtype FSDP would compute in; so is activation checkpointing, whose recompute needs the autograd engine
  (the blocks' own code is the same with it);
- the trainer's own micro-batch loop (`run_micro_batches`) over the rank's first and last micro-batches, with the
  MoE balancer's device side (its statistics, histograms and the sequence-wise loss's scale) around it;
- its backward, with torch's autograd engine replaced by a walk that calls every node of the graph itself
  (`lmforge.plan.graph_backward`), since the engine needs a GPU: every backward formula runs, lmforge's own
  `autograd.Function`s included, each with its real context.

Problems are errors the fake kernels raise (device mismatch, dtype, a value read on the host) and copies from the
GPU to the host, each named with the module it happened in and the innermost line outside torch that issued it.
The optimizer update is not run: it works on FSDP's sharded parameters (`lmforge plan` traces it on the CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lmforge.config.train import TrainConfig
from lmforge.model.attention import describe_backend
from lmforge.parallel.context import shard_micro_batch
from lmforge.parallel.fsdp import resolve_param_dtype
from lmforge.parallel.model_setup import build_run_model
from lmforge.plan.attention import stand_in_for_flex
from lmforge.plan.batches import plan_batches
from lmforge.plan.experts import balance_dispatches
from lmforge.plan.graph_backward import engine_replaced
from lmforge.plan.step import CUDA, fake_world, plan_tokenizer
from lmforge.train.callbacks.balancing import moe_balancer
from lmforge.train.micro_batches import run_micro_batches

MODULE_LABEL = "lmforge_module"
"""Key of an autograd node's `metadata` naming the module whose forward made it."""

_TORCH_ROOT = str(Path(torch.__file__).resolve().parent)
_HERE = {str(Path(__file__).resolve()), str(Path(__file__).resolve().with_name("graph_backward.py"))}


class CudaBuildMissing(RuntimeError):
    """The installed torch cannot make CUDA tensors, fake or not."""


class HostRead(RuntimeError):
    """A value copied from the GPU to the host inside the step (on a GPU, the host would wait for the device)."""


def cuda_build_missing() -> str | None:
    """Why this torch cannot run the check, or None when it can."""
    if torch.backends.cuda.is_built():
        if not hasattr(torch.autograd, "_engine_run_backward") or not hasattr(Node, "_input_metadata"):
            return (f"--check-cuda walks the backward through torch's private `torch.autograd._engine_run_backward` "
                    f"and `Node._input_metadata`, which this torch {torch.__version__} lacks")  # fmt: skip
        return None
    return (f"--check-cuda needs the CUDA build of torch (no GPU needed); this torch {torch.__version__} is "
            "CPU-only. Install one in an environment of its own, e.g. `python3 -m venv .venv-cuda && "
            ".venv-cuda/bin/pip install torch==2.14.1 -e .` (docs/plan.md)")  # fmt: skip


@dataclass(frozen=True)
class CudaProblem:
    """One failure of the step on fake CUDA tensors."""

    phase: str
    """`forward` (the model and the loss) or `backward`."""
    module: str
    """The module whose forward was running, or made the failing backward node (`model` for the root)."""
    where: str
    """`file:line (function)` of the innermost frame outside torch that issued it."""
    error: str
    """The exception's type and first line."""
    node: str = ""
    """The backward node that failed (`RMSNormFunctionBackward`, ...)."""


@dataclass
class CudaCheck:
    """What the check ran and what failed."""

    problems: list[CudaProblem]
    """Distinct failures, in the order met."""
    counts: Counter[CudaProblem]
    """How often each failure happened (a problem in a block's code fails once per block)."""
    micro_batches: int
    """Micro-batches run (rank 0's first and last)."""
    backward_nodes: Counter[str]
    """Autograd nodes the backward walk called, by name."""
    own_backwards: Counter[str]
    """lmforge's own `autograd.Function` backwards among them."""
    choices: dict[str, str]
    """The CUDA choices the model made."""
    notes: list[str] = field(default_factory=list)
    """What the check stood in for."""

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


def where_raised(error: BaseException) -> str:
    """`file:line (function)` of the innermost frame of `error`'s traceback outside torch and this check."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(_TORCH_ROOT) and f.filename not in _HERE]  # fmt: skip
    if not frames:
        return "inside torch"
    frame = frames[-1]
    path = Path(frame.filename)
    with contextlib.suppress(ValueError):
        path = path.relative_to(Path.cwd())
    return f"{path}:{frame.lineno} ({frame.name})"


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


class HostReads(TorchDispatchMode):
    """Raises `HostRead` for a copy from a CUDA tensor to the host and for a scalar read of one (`.item()`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default and args[0].device.type == "cuda":
            raise HostRead("a scalar read of a CUDA tensor (.item(), bool(), int())")
        if func is aten._to_copy.default and args[0].device.type == "cuda":
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu":
                raise HostRead(f"a copy of a CUDA tensor {tuple(args[0].shape)} to the host (.cpu(), .to('cpu'))")
        if func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type == "cuda":
            raise HostRead(f"a copy of a CUDA tensor {tuple(args[1].shape)} into a host tensor")
        return func(*args, **kwargs)


class ModuleTrail:
    """Which module's forward is running, and which module made each autograd node (its `metadata`)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {module: name or "model" for name, module in model.named_modules()}
        self.stack: list[tuple[str, set[Node]]] = []

    def current(self) -> str:
        """The innermost module whose forward is running (or was, when it raised)."""
        return self.stack[-1][0] if self.stack else "model"

    @staticmethod
    def _nodes(values: Any) -> list[Node]:
        return [t.grad_fn for t in tree_flatten(values)[0] if isinstance(t, Tensor) and t.grad_fn is not None]

    def _before(self, module: nn.Module, args: Any) -> None:
        if module in self.names:
            self.stack.append((self.names[module], set(self._nodes(args))))

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if module not in self.names:
            return
        name, inputs = self.stack.pop()
        # Inner modules finish first: each labels the nodes between its inputs and its outputs that no inner module
        # claimed.
        todo = self._nodes(output)
        while todo:
            node = todo.pop()
            if node in inputs or MODULE_LABEL in node.metadata:
                continue
            node.metadata[MODULE_LABEL] = name
            todo.extend(n for n, _ in node.next_functions if n is not None)

    @contextlib.contextmanager
    def watching(self) -> Iterator[ModuleTrail]:
        """Follow every module forward within this block."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = [register_module_forward_pre_hook(self._before), register_module_forward_hook(self._after)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def _own_function_names() -> set[str]:
    """Backward node names of lmforge's own `autograd.Function`s."""
    names, todo = set(), list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("lmforge."):
            names.add(f"{cls.__name__}Backward")
    return names


def check_cuda(
    config: TrainConfig, world_size: int, doc_len: float | None = None, vocab_size: int | None = None
) -> CudaCheck:
    """Run rank 0's step of `config` on `world_size` GPUs on fake CUDA tensors (see the module). Raises
    `CudaBuildMissing` on a CPU-only torch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    missing = cuda_build_missing()
    if missing:
        raise CudaBuildMissing(missing)
    notes = ["FSDP left out (it needs CUDA streams); parameters cast to its compute dtype"]
    if config.model.compile:
        notes.append("compile: the eager step is checked")
    if config.model.ac.mode != "none":
        # Checkpointing's recompute is keyed to the engine's graph task, which the walk has none of: it would
        # recompute a block for every saved tensor (minutes), or refuse (selective). The blocks' code is the same.
        notes.append(f"activation checkpointing ({config.model.ac.mode}) left out: the blocks run as they are")
    no_ac = config.model.ac.model_copy(update={"mode": "none"})
    config = config.model_copy(update={"model": config.model.model_copy(update={"compile": False, "ac": no_ac})})
    tokenizer, vocab_note = plan_tokenizer(config, vocab_size)
    if vocab_note:
        notes.append(vocab_note)
    problems: Counter[CudaProblem] = Counter()
    # CUDA meshes: DTensor's collectives (tensor parallelism) then keep the fake CUDA tensors on the device
    ctx = fake_world(config, world_size, mesh_device="cuda")
    try:
        rows = plan_batches(config, None if vocab_note else tokenizer, ctx.dp_size, doc_len).micro_batches
        micro_batches = [shard_micro_batch(mb, ctx.cp) for mb in rows]
        traced = [micro_batches[0], micro_batches[-1]] if len(micro_batches) > 1 else micro_batches
        meta = dataclasses.replace(ctx, device=torch.device("meta"))
        model = build_run_model(config, tokenizer, meta, target=CUDA, shard=False)
        dtype = resolve_param_dtype(config.model.param_dtype, CUDA)
        trail = ModuleTrail(model)
        ran: Counter[str] = Counter()

        def failed(node: Node, error: BaseException) -> None:
            module = node.metadata.get(MODULE_LABEL, "model")
            problems[CudaProblem("backward", module, where_raised(error), _describe(error), node.name())] += 1

        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            trail.watching(),
            engine_replaced(failed, ran),
            HostReads(),
        ):
            model.to_empty(device=CUDA)
            for module in model.modules():
                # New parameters: setting `.data` of a DTensor (tensor parallelism) leaves its local part's dtype
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[name] = nn.Parameter(p.detach().to(dtype), p.requires_grad)
            model.tie_weights()
            if balance_dispatches(model):
                notes.append("expert parallelism: exchanges sized as balanced routing (its one documented host "
                             "read stood in for)")  # fmt: skip
            if stand_in_for_flex(model):
                notes.append("flex attention compiles only on a GPU: its kernel is stood in for (its inputs, "
                             "output and sinks' gradient keep their shapes, dtypes and devices)")  # fmt: skip
            # The MoE balancer's part of the step runs on the device: its routing statistics, histograms (quantile
            # rule) and the sequence-wise loss's scale, then the statistics the step's reduction sends.
            balancer = moe_balancer(model, config.model.moe_balance, config.max_steps)
            try:
                if balancer is not None:
                    balancer.start_step(traced, 1)
                run_micro_batches(model, traced, CUDA)
                if balancer is not None:
                    balancer.device_stats()
            except Exception as e:  # the failure is the check's finding
                problems[CudaProblem("forward", trail.current(), where_raised(e), _describe(e))] += 1
        own = _own_function_names()
        choices = {
            "attention": describe_backend(model.attn_backend, CUDA),
            "parameters": str(dtype).removeprefix("torch."),
            "loss": f"chunks of {model.loss_chunk_tokens} tokens" if model.loss_chunk_tokens else "full logits",
            "fp8": config.model.fp8,
            "context parallel": str(ctx.cp.size),
            "expert parallel": str(ctx.ep.size),
            "tensor parallel": str(ctx.tp.size),
        }
        return CudaCheck(
            problems=list(problems), counts=problems, micro_batches=len(traced), backward_nodes=ran,
            own_backwards=Counter({n: c for n, c in ran.items() if n in own}), choices=choices, notes=notes,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def render_check(check: CudaCheck, console: Any) -> None:
    """Print what the check ran and every problem it found."""
    from rich.table import Table

    choices = ", ".join(f"{k} {v}" for k, v in check.choices.items())
    console.print(f"CUDA check on fake CUDA tensors ({torch.__version__}): {choices}")
    own = ", ".join(f"{n} x{c}" for n, c in sorted(check.own_backwards.items())) or "none"
    console.print(f"ran {check.micro_batches} micro-batch(es) forward and backward: "
                  f"{check.backward_nodes.total()} backward nodes; lmforge's own: {own}")  # fmt: skip
    for note in check.notes:
        console.print(f"note: {note}")
    if check.ok:
        console.print("no problem found")
        return
    table = Table(title=f"{len(check.problems)} problem(s)")
    for column in ("phase", "module", "where", "error", "times"):
        table.add_column(column, overflow="fold")
    for p in check.problems:
        table.add_row(p.phase + (f" {p.node}" if p.node else ""), p.module, p.where, p.error, str(check.counts[p]))
    console.print(table)
