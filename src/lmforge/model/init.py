"""From-scratch weight init whose values depend only on the seed, the parameter names and row blocks.

Each parameter is cut into blocks of `ROWS_PER_BLOCK` rows (dim 0); every block draws from its own generator,
seeded from (seed, canonical parameter name, block index). A rank holding an FSDP2 shard (a range of rows) draws
only the blocks that overlap its rows, so no rank materializes a full parameter, and the values are the same on
any world size and under any sharding.

A stacked expert tensor [E, rows, cols] is drawn per expert: expert e's matrix is cut into row blocks of its own,
seeded from (seed, `name[e]`, block). A rank draws only the experts it holds (its FSDP rows of its expert-parallel
share), whatever E, the world size or `parallel.ep`.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lmforge.model.roles import param_role

ROWS_PER_BLOCK = 64
"""Rows drawn from one generator: small enough that a shard boundary wastes little, large enough to be fast."""


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one row block of one parameter (stable across runs, machines and Python versions)."""
    digest = hashlib.blake2b(f"{seed}|{name}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_role(name: str, param: Tensor, rules: dict[str, str] | None = None) -> str:
    """How a parameter is initialized: `normal` (matrices, embeddings), `one` (norm scales) or `zero` (biases);
    `rules` (name -> one/zero/declared) declares the parameters of modules that are neither, `declared` ones taking
    the value their module's `init_value(local_name)` gives (hyper-connection weights)."""
    if rules and name in rules:
        return rules[name]
    if name.endswith(".bias"):
        return "zero"
    if param.ndim >= 2:
        return "normal"
    leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
    if leaf.endswith("norm") and name.endswith(".weight"):
        return "one"
    raise ValueError(
        f"no init rule for 1-D parameter {name!r}: only norm weights and biases are known; give its module an init rule"
    )


def declared_init_rules(model: nn.Module) -> dict[str, str]:
    """Init rules that modules declare for their own parameters: a module's `init_rules` maps a local parameter
    name to `one`, `zero` or `declared` (then its `init_value(local_name)` is the full initial tensor)."""
    rules: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for local, rule in getattr(module, "init_rules", {}).items():
            rules[f"{prefix}.{local}" if prefix else local] = rule
    return rules


def output_projections(model: nn.Module) -> list[str]:
    """The parameters that are the last matrix of a residual branch, the ones `zero_out_proj` starts at zero:
    attention's `o_proj`, the dense MLP's and the shared experts' `down_proj` (role `residual_out`), and the routed
    experts' `down_proj` stack (`expert_out`). In a LatentMoE block the routed experts' branch ends in
    `latent_up_proj` (also `residual_out`) instead, and their `down_proj` keeps its normal init: with both at zero
    each would get a zero gradient from the other and neither could ever move."""
    names = dict(model.named_parameters())
    chosen = []
    for name, param in names.items():
        role = param_role(name, param.ndim)
        if role == "expert_out":
            block = name.rpartition(".experts.")[0]
            if f"{block}.latent_up_proj.weight" in names:
                continue
        if role in ("residual_out", "expert_out"):
            chosen.append(name)
    return chosen


def local_block(param: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """This rank's part of a parameter and the global index of its first element in every dimension: FSDP2 shards
    rows like `torch.chunk`, tensor parallelism rows or columns, one inside the other; the whole tensor and zeros
    for a plain tensor."""
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.ndim
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(offset)


def _columns(rows: Tensor, local: Tensor, offset: tuple[int, ...]) -> Tensor:
    """Of full-width rows, the columns (and further dimensions) `local` holds from `offset` on."""
    if tuple(rows.shape[1:]) == tuple(local.shape[1:]):
        return rows
    index = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    return rows[(slice(None), *index)]


def _draw(shape: tuple[int, ...], std: float, truncate: bool, gen: torch.Generator) -> Tensor:
    values = torch.empty(shape, dtype=torch.float32)
    if truncate:
        return nn.init.trunc_normal_(values, 0.0, std, -3 * std, 3 * std, generator=gen)
    return values.normal_(0.0, std, generator=gen)


def normal_rows(name: str, shape: tuple[int, ...], start: int, count: int, std: float, seed: int,
                truncate: bool = False) -> Tensor:  # fmt: skip
    """Rows [start, start + count) of the parameter `name` of full `shape`, drawn block by block."""
    if count == 0:
        return torch.empty((0, *shape[1:]))
    rest, rows = shape[1:], shape[0]
    first, last = start // ROWS_PER_BLOCK, (start + count - 1) // ROWS_PER_BLOCK
    parts = []
    for block in range(first, last + 1):
        lo, hi = block * ROWS_PER_BLOCK, min((block + 1) * ROWS_PER_BLOCK, rows)
        gen = torch.Generator(device="cpu").manual_seed(block_seed(seed, name, block))
        values = _draw((hi - lo, *rest), std, truncate, gen)
        parts.append(values[max(start, lo) - lo : min(start + count, hi) - lo])
    return torch.cat(parts)


def expert_rows(name: str, shape: tuple[int, ...], first: int, count: int, std: float, seed: int,
                truncate: bool = False) -> Tensor:  # fmt: skip
    """Experts [first, first + count) of the stacked expert parameter `name` whose experts have `shape`
    ([rows, cols]), each drawn block by block under its own name `name[e]`."""
    if count == 0:
        return torch.empty((0, *shape))
    return torch.stack(
        [normal_rows(f"{name}[{e}]", shape, 0, shape[0], std, seed, truncate) for e in range(first, first + count)]
    )


def reset_buffers(model: nn.Module) -> None:
    """Give every buffer of `model` its fresh-init value: each module that owns buffers with state (an MoE block's
    selection bias and statistics) declares a `reset_buffers()`; buffers of other modules are computed on the fly."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


@torch.no_grad()
def init_weights(
    model: nn.Module,
    std: float,
    seed: int,
    truncate: bool = False,
    std_scales: dict[str, float] | None = None,
    zero_out_proj: bool = False,
) -> None:
    """Initialize every parameter, plain or FSDP2-sharded, in place: N(0, std x std_scale(name)) for matrices,
    stacked expert matrices and embeddings (truncated at 3 std if asked; `std_scales` multiplies a parameter's std,
    e.g. for CompleteP), 1 for norm scales, 0 for biases, a module's declared value for its `declared` parameters;
    only this rank's rows are drawn (an expert stack's rows are its experts, each drawn on its own: `expert_rows`).
    With `zero_out_proj` the residual branches' output projections (`output_projections`) start at zero instead;
    every other parameter draws exactly the values it draws without it (each has generators of its own).
    Buffers are reset too: an MoE selection bias starts at zero."""
    rules = declared_init_rules(model)
    if zero_out_proj:
        rules.update(dict.fromkeys(output_projections(model), "zero"))
    for name, param in model.named_parameters():
        role = init_role(name, param, rules)
        local, corner = local_block(param)
        start = corner[0] if corner else 0
        if role == "one":
            local.fill_(1.0)
        elif role == "zero":
            local.zero_()
        elif role == "declared":
            prefix, _, leaf = name.rpartition(".")
            value = model.get_submodule(prefix).init_value(leaf)
            local.copy_(_columns(value[start : start + local.shape[0]], local, corner))
        else:
            scale = std_scales.get(name, 1.0) if std_scales is not None else 1.0
            owner = model.get_submodule(name.rpartition(".")[0])
            offset = getattr(owner, "expert_offset", None)
            if offset is not None and param.ndim == 3:
                rows = expert_rows(name, tuple(param.shape[1:]), offset + start, local.shape[0], std * scale, seed,
                                   truncate)  # fmt: skip
            else:
                rows = normal_rows(name, tuple(param.shape), start, local.shape[0], std * scale, seed, truncate)
            local.copy_(_columns(rows, local, corner))
    reset_buffers(model)
