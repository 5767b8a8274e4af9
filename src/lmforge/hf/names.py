"""Tensor names and layouts between an lmforge model and the files of an HF checkpoint.

Dense tensors keep their names. Routed experts are stacked in the model (`mlp.experts.gate_up_proj` [E, 2I, H],
gate rows first, and `mlp.experts.down_proj` [E, H, I], as transformers 5 holds them in memory) but stored per
expert in HF checkpoint files (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]),
which every transformers version, vLLM and SGLang read; transformers 5 saves that layout too. Loading also accepts
the stacked names (a transformers 5 save with `save_original_format=False`).

gpt-oss checkpoints keep their experts stacked, in their own layout (`GPT_OSS_LAYOUT`): `mlp.experts.gate_up_proj`
[E, H, 2I] with the gate and up columns interleaved (gate 2i, up 2i + 1), its bias `gate_up_proj_bias` [E, 2I]
interleaved alike, `down_proj` [E, I, H] and `down_proj_bias` [E, H]; the router is `mlp.router` (lmforge's
`mlp.gate`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from lmforge.config.arch import AnyArch
from lmforge.model.moe import MoE

_GATE_UP = ".mlp.experts.gate_up_proj"
_DOWN = ".mlp.experts.down_proj"
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
_MTP_RE = re.compile(r"model\.mtp_layers\.(\d+)\.(.*)")
MTP_SHARED = (".embed_tokens.weight", ".shared_head.head.weight")
"""What each MTP layer of a DeepSeek checkpoint also holds: copies of the shared embedding and LM head."""


@dataclass(frozen=True)
class Source:
    """Where one model tensor comes from in a checkpoint: the file tensors and how they combine."""

    names: tuple[str, ...]
    """Checkpoint tensor names, in the order `assemble` takes them."""
    kind: Literal["same", "gate_up", "stack", "transpose", "interleaved", "interleaved_t"]
    """`same`: one tensor as is; `gate_up`: per-expert gate and up matrices (g0, u0, g1, u1, ...) concatenated and
    stacked; `stack`: per-expert matrices stacked; gpt-oss's stacks: `transpose` (the last two dimensions swapped),
    `interleaved` (gate and up alternating along the last dimension), `interleaved_t` (both)."""

    def piece_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The shape each checkpoint tensor must have for a model tensor of `shape`."""
        if self.kind in ("transpose", "interleaved_t"):
            return [(shape[0], shape[2], shape[1])]
        if self.kind in ("same", "interleaved"):
            return [shape]
        if self.kind == "gate_up":
            return [(shape[1] // 2, shape[2])] * len(self.names)
        return [tuple(shape[1:])] * len(self.names)

    def assemble(self, pieces: list[Tensor]) -> Tensor:
        """The model tensor from its checkpoint tensors."""
        if self.kind == "same":
            return pieces[0]
        if self.kind in GPT_OSS_TO_MODEL:
            return GPT_OSS_TO_MODEL[self.kind](pieces[0])
        if self.kind == "gate_up":
            return torch.stack([torch.cat(pieces[i : i + 2]) for i in range(0, len(pieces), 2)])
        return torch.stack(pieces)


def _interleave(t: Tensor) -> Tensor:
    """[..., 2I] gate half first -> gate and up alternating (gate i at 2i, up i at 2i + 1)."""
    return t.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def _deinterleave(t: Tensor) -> Tensor:
    """The inverse of `_interleave`."""
    return t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


GPT_OSS_TO_MODEL = {
    "transpose": lambda t: t.transpose(1, 2).contiguous(),
    "interleaved": _deinterleave,
    "interleaved_t": lambda t: _deinterleave(t).transpose(1, 2).contiguous(),
}
"""gpt-oss checkpoint layout -> model layout, by `Source.kind`."""

GPT_OSS_TO_FILE = {
    "transpose": lambda t: t.transpose(1, 2).contiguous(),
    "interleaved": _interleave,
    "interleaved_t": lambda t: _interleave(t.transpose(1, 2)).contiguous(),
}
"""Model layout -> gpt-oss checkpoint layout, by `Source.kind`."""

GPT_OSS_LAYOUT = {
    ".mlp.experts.gate_up_proj": "interleaved_t",
    ".mlp.experts.gate_up_proj_bias": "interleaved",
    ".mlp.experts.down_proj": "transpose",
}
"""The gpt-oss expert tensors whose checkpoint layout differs from the model's (by name suffix)."""


def gpt_oss_name(name: str) -> tuple[str, str]:
    """A model tensor's gpt-oss checkpoint name and `Source.kind`: the router is `mlp.router`, three expert stacks
    have their own layout (`GPT_OSS_LAYOUT`), everything else is the same."""
    for suffix, kind in GPT_OSS_LAYOUT.items():
        if name.endswith(suffix):
            return name, kind
    return name.replace(".mlp.gate.", ".mlp.router."), "same"


def persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers that belong in a state dict (an MoE router's selection bias), by full name."""
    found: dict[str, Tensor] = {}
    for prefix, module in model.named_modules():
        for local, buf in module.named_buffers(recurse=False):
            if buf is not None and local not in module._non_persistent_buffers_set:
                found[f"{prefix}.{local}" if prefix else local] = buf
    return found


def file_name(name: str, arch: AnyArch | None = None) -> str:
    """The checkpoint name of model tensor `name`: the same, except the MTP modules (`model.mtp_layers.{k}.*`),
    which DeepSeek's checkpoints store as decoder layers `num_hidden_layers + k`."""
    match = _MTP_RE.match(name)
    if match is None or arch is None:
        return name
    return f"model.layers.{arch.num_hidden_layers + int(match.group(1))}.{match.group(2)}"


def checkpoint_sources(
    targets: dict[str, Tensor], available: set[str], arch: AnyArch | None = None
) -> dict[str, Source]:
    """For each model tensor, its source in a checkpoint holding `available` names: the same name (`file_name`), or
    for routed experts the stacked name when present, else the per-expert names; for gpt_oss, its own names and
    layouts (`gpt_oss_name`)."""
    sources: dict[str, Source] = {}
    for target, tensor in targets.items():
        if getattr(arch, "model_type", "") == "gpt_oss":
            hf_name, kind = gpt_oss_name(target)
            sources[target] = Source((hf_name,), kind)  # type: ignore[arg-type]
            continue
        name = file_name(target, arch)
        if name in available or not name.endswith((_GATE_UP, _DOWN)):
            sources[target] = Source((name,), "same")
            continue
        prefix = name.rsplit(".", 1)[0]
        experts = range(tensor.shape[0])
        if name.endswith(_GATE_UP):
            names = tuple(f"{prefix}.{e}.{part}.weight" for e in experts for part in ("gate_proj", "up_proj"))
            sources[target] = Source(names, "gate_up")
        else:
            sources[target] = Source(tuple(f"{prefix}.{e}.down_proj.weight" for e in experts), "stack")
    return sources


def ignored_checkpoint_name(name: str, model: nn.Module) -> bool:
    """Checkpoint tensors that lmforge does not load: GLM-4.5's and DeepSeek-V3's multi-token-prediction layers,
    stored as decoder layers after the last one (transformers skips them too), beyond the MTP modules the model
    has; and those modules' copies of the shared embedding and LM head (`MTP_SHARED`)."""
    arch = getattr(model, "arch", None)
    if arch is None or arch.model_type not in ("glm4_moe", "deepseek_v3"):
        return False
    match = _LAYER_RE.match(name)
    if match is None or int(match.group(1)) < arch.num_hidden_layers:
        return False
    kept = arch.num_hidden_layers + getattr(arch, "num_nextn_predict_layers", 0)
    return int(match.group(1)) >= kept or name.endswith(MTP_SHARED)


def fp32_names(model: nn.Module) -> set[str]:
    """Tensors an export keeps in fp32 whatever its dtype: the routers that carry a selection bias, and the bias
    (transformers keeps both in fp32 for GLM-4.5)."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, MoE) and module.spec.selection_bias:
            names |= {f"{prefix}.gate.weight", f"{prefix}.gate.e_score_correction_bias"}
    return names


def export_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The tensors of an HF checkpoint of `model` (plain, unsharded), by HF name: its state dict without the second name
    of a tied matrix, routed experts split per expert (gpt-oss: stacked, in its layout), cast to `dtype` (None: as they
    are) except the tensors `fp32_names` keeps."""
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
    keep = fp32_names(model)
    arch = getattr(model, "arch", None)
    gpt_oss = getattr(arch, "model_type", "") == "gpt_oss"
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in aliases:
            continue
        target = torch.float32 if name in keep else dtype
        t = tensor.detach() if target is None else tensor.detach().to(target)
        prefix = file_name(name, arch).rsplit(".", 1)[0]
        if gpt_oss:
            hf_name, kind = gpt_oss_name(name)
            out[hf_name] = GPT_OSS_TO_FILE[kind](t) if kind in GPT_OSS_TO_FILE else t
        elif name.endswith(_GATE_UP):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith(_DOWN):
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[file_name(name, arch)] = t
    for k in range(len(getattr(getattr(model, "model", None), "mtp_layers", ()))):
        assert arch is not None
        layer = f"model.layers.{arch.num_hidden_layers + k}"
        for suffix, source in zip(MTP_SHARED, ("model.embed_tokens.weight", "lm_head.weight"), strict=True):
            if source in out:
                out[layer + suffix] = out[source].clone()
    return out
