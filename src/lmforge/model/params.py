"""Parameter counts of a model, total and active per token (MoE routed experts count top_k / num_experts)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lmforge.model.moe import Experts, MoE
from lmforge.model.roles import param_role


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (global sizes, also under FSDP; a tied matrix counts once unless said otherwise)."""

    total: int
    """Every parameter."""
    embedding: int
    """The token embedding."""
    non_embedding: int
    """total - embedding (the LM head included when it is not tied)."""
    active_non_embedding: float
    """Non-embedding parameters one token uses: dense parts, routers, shared experts and LatentMoE's latent
    projections whole, routed experts times top_k / num_experts."""
    active_matmul: float
    """Active weights (2-D and stacked 3-D, not the stacked expert biases) outside the embedding that a token
    multiplies, the LM head counted even when tied: N_matmul of the 6 N D FLOP count. Hyper-connection parameters are
    left out: they are tiny, and their cost (mixing n stream copies) is not one multiply-add per weight and token."""

    def metrics(self) -> dict[str, float]:
        """The step-0 `params/*` metrics."""
        return {
            "params/total": float(self.total),
            "params/embedding": float(self.embedding),
            "params/non_embedding": float(self.non_embedding),
            "params/active_non_embedding": float(self.active_non_embedding),
        }


def active_fractions(model: nn.Module) -> dict[str, float]:
    """Name -> share of a token's compute, for the parameters a token uses only in part: the routed experts of
    every MoE block (top_k / num_experts). Absent names are fully active."""
    fractions: dict[str, float] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoE):
            # With null experts, the expected share once balanced: each of the k choices lands on a given expert
            # with probability 1 / (routed + null).
            share = module.spec.top_k / (module.spec.num_experts + module.spec.null_experts)
            for local, _ in module.experts.named_parameters():
                fractions[f"{prefix}.experts.{local}" if prefix else f"experts.{local}"] = share
    return fractions


def whole_sizes(model: nn.Module, remove_duplicate: bool = True) -> dict[str, int]:
    """Name -> element count of each parameter of the whole model: under expert parallelism a rank's expert stacks
    hold E / ep of each block's experts, and count as the whole stacks (FSDP's DTensors already report whole
    sizes)."""
    sizes = {}
    for name, p in model.named_parameters(remove_duplicate=remove_duplicate):
        owner = model.get_submodule(name.rpartition(".")[0])
        # every parameter of an expert module (weights and biases) is a stack along the experts
        stacked = isinstance(owner, Experts)
        sizes[name] = p.numel() // p.shape[0] * owner.num_experts if stacked else p.numel()
    return sizes


def count_params(model: nn.Module) -> ParamCounts:
    """Count `model`'s parameters by role and activity (see `ParamCounts`)."""
    fractions = active_fractions(model)
    total = embedding = 0
    active = 0.0
    ndims = {name: p.ndim for name, p in model.named_parameters(remove_duplicate=False)}
    for name, n in whole_sizes(model).items():
        total += n
        if param_role(name, ndims[name]) == "embed":
            embedding += n
        else:
            active += n * fractions.get(name, 1.0)
    matmul = 0.0
    for name, n in whole_sizes(model, remove_duplicate=False).items():
        if ndims[name] >= 2 and param_role(name, ndims[name]) not in ("embed", "hyper", "bias"):
            matmul += n * fractions.get(name, 1.0)
    return ParamCounts(total, embedding, total - embedding, active, matmul)
