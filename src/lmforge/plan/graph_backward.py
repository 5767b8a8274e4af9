"""A backward pass that calls every node of the autograd graph itself, in dependency order.

torch's autograd engine cannot run on fake CUDA tensors without a GPU: it sets up the device of each tensor's
graph task (`hasPrimaryContext expects a valid device index`). Each node of the graph can still be called directly,
with the gradients of its outputs, and the custom `autograd.Function`s run their own `backward` with their real
context. `lmforge plan --check-cuda` runs the trainer's backward this way (`engine_replaced`), so every backward
formula of a CUDA step runs on fake CUDA tensors.

What the engine does and this walk does not: no node or tensor hooks run (the check's model has no FSDP, whose
reductions are hooks), and a gradient an output never received is passed as zeros of its recorded shape (the
engine passes an undefined tensor, which most formulas treat as zeros).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

NodeFailure = Callable[[Node, BaseException], None]
"""Called with a node whose backward raised, and the exception; the walk goes on with zeros for its inputs."""


def _reachable(roots: Sequence[Node]) -> Counter[Node]:
    """How many edges of the graph under `roots` lead into each node."""
    into: Counter[Node] = Counter()
    seen: set[Node] = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        for following, _ in node.next_functions:
            if following is None:
                continue
            into[following] += 1
            if following not in seen:
                seen.add(following)
                stack.append(following)
    return into


def _checked(node: Node, index: int, grad: Tensor | None) -> Tensor | None:
    """Gradient `index` that `node` returned, checked against the input it belongs to as the engine checks it: the
    same device (a CPU scalar aside), a shape that sums down to the input's, and cast to the input's dtype."""
    if grad is None or index >= len(node.next_functions) or node.next_functions[index][0] is None:
        return grad
    following, slot = node.next_functions[index]
    meta = following._input_metadata[slot]
    if grad.device != meta.device and not (grad.device.type == "cpu" and grad.dim() == 0):
        raise RuntimeError(f"{node.name()} returned gradient {index} on {grad.device}, for an input on {meta.device}")
    if grad.shape != meta.shape:
        try:
            grad = grad.sum_to_size(meta.shape)
        except RuntimeError:
            raise RuntimeError(f"{node.name()} returned gradient {index} of shape {tuple(grad.shape)}, for an input "
                               f"of shape {tuple(meta.shape)}") from None  # fmt: skip
    return grad.to(meta.dtype) if grad.dtype != meta.dtype else grad


def _zeros(meta: Any) -> Tensor:
    return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)


def run_graph_backward(
    outputs: Sequence[Tensor], grads: Sequence[Tensor | None], on_failure: NodeFailure
) -> Counter[str]:
    """Backpropagate `grads` (None: ones, for a scalar) from `outputs` into the `.grad` of the leaves, calling
    each node in turn; returns how many times each kind of node ran (by `Node.name()`)."""
    roots: list[Node] = []
    pending: dict[Node, list[Tensor | None]] = {}
    for out, grad in zip(outputs, grads, strict=True):
        node = out.grad_fn
        if node is None:
            continue
        grad = torch.ones_like(out) if grad is None else grad
        if node not in pending:
            roots.append(node)
            pending[node] = [None] * len(node._input_metadata)
        # A root's own gradient slot is the output's position among its node's outputs (0 for a fresh result).
        pending[node][out.output_nr] = grad
    into = _reachable(roots)
    ran: Counter[str] = Counter()
    ready = [n for n in roots if into[n] == 0]
    while ready:
        node = ready.pop()
        received = pending.pop(node, None) or [None] * len(node._input_metadata)
        inputs = [g if g is not None else _zeros(m) for g, m in zip(received, node._input_metadata, strict=True)]
        ran[node.name()] += 1
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: the leaf's gradient sums what reaches it
            grad = inputs[0].detach()
            variable.grad = grad if variable.grad is None else variable.grad + grad
            continue
        try:
            # A custom Function's node runs its `backward` through `apply`; torch's own nodes are called.
            results = node.apply(*inputs) if isinstance(node, BackwardCFunction) else node(*inputs)
            if not isinstance(results, tuple):
                results = (results,)
            results = tuple(_checked(node, i, g) for i, g in enumerate(results))
        except Exception as e:  # every failure is reported by the caller, and the walk goes on
            on_failure(node, e)
            results = ()
        for index, (following, slot) in enumerate(node.next_functions):
            if following is None:
                continue
            grad = results[index] if index < len(results) else None
            if grad is not None:
                slots = pending.setdefault(following, [None] * len(following._input_metadata))
                slots[slot] = grad if slots[slot] is None else slots[slot] + grad
            into[following] -= 1
            if into[following] == 0:
                ready.append(following)
    return ran


@contextlib.contextmanager
def engine_replaced(on_failure: NodeFailure, ran: Counter[str]) -> Iterator[None]:
    """Within this block, `Tensor.backward` and `torch.autograd.backward` walk the graph with `run_graph_backward`
    instead of torch's engine, adding the nodes run to `ran`. `torch.autograd.grad` is not replaced."""
    import torch.autograd as autograd

    original = autograd._engine_run_backward  # type: ignore[attr-defined]

    def walk(outputs: Sequence[Tensor], grads: Sequence[Tensor | None], *args: Any, **kwargs: Any) -> tuple[()]:
        ran.update(run_graph_backward(list(outputs), list(grads), on_failure))
        return ()

    autograd._engine_run_backward = walk  # type: ignore[attr-defined]
    try:
        yield
    finally:
        autograd._engine_run_backward = original  # type: ignore[attr-defined]
