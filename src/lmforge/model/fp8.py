"""FP8 training of the decoder blocks' linear layers through torchao's float8 training (`model.fp8`).

Each converted `nn.Linear` becomes torchao's `Float8Linear`: in forward and backward its input, weight and output
gradient are cast to float8 (e4m3 for input and weight, e5m2 for the gradient under `tensorwise`; e4m3 throughout
under `rowwise`) with scales computed from the current values (dynamic scaling), and the three matmuls run as
float8 matmuls (`torch._scaled_mm`) with higher-precision accumulation. Master weights, optimizer state and the
gradient reduction keep their dtypes; parameter names and state dicts are unchanged, so checkpoints, resume and
exports do not know FP8 was used.

- `tensorwise`: one scale per tensor. The fastest recipe; under FSDP2 the weights are all-gathered in float8
  (half the bytes of bf16), their scales precomputed once per optimizer step.
- `rowwise`: one scale per row (per column for the other operand), more robust to outliers, somewhat slower.

What stays in high precision: the LM head and embeddings (not in the blocks), MoE routers and routed experts (not
`nn.Linear`), and every linear layer whose in- or out-features are not multiples of 16 (the float8 matmul needs
them). FP8 matmuls need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell). On other devices
`model.fp8_emulate = true` runs the same casts and scales with high-precision matmuls: numerically FP8's rounding,
not its speed; it is what CPU tests use.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from lmforge.config.loader import ConfigError

FP8_ALIGN = 16
"""Float8 matmuls need both dimensions of a weight to be multiples of this."""

MIN_CAPABILITY = (8, 9)
"""The oldest CUDA compute capability with FP8 tensor cores (Ada)."""


def _torchao_float8() -> Any:
    """torchao's float8 module; its import logs a warning per CUDA extension it cannot load, which float8 training
    does not use."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ModuleNotFoundError as err:
        raise ConfigError(f"model.fp8 needs torchao (pip install torchao): {err}") from err
    except ImportError as err:
        # Each torchao release is built against one torch release and may not import with another.
        raise ConfigError(
            f"model.fp8: torchao does not import with torch {torch.__version__} ({err}); install the torchao "
            "release made for this torch (docs/model.md#fp8-training-modelfp8)"
        ) from err
    finally:
        quiet.setLevel(level)
    return float8


def check_fp8_device(recipe: str, emulate: bool, device: torch.device) -> None:
    """Raise a ConfigError when `device` cannot run FP8 matmuls and emulation is off."""
    if recipe == "none" or emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"model.fp8 = {recipe!r} needs a CUDA GPU of compute capability >= 8.9; on {device.type} set "
            "model.fp8_emulate = true (FP8's rounding with high-precision matmuls, for tests)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"model.fp8 = {recipe!r} needs FP8 tensor cores (compute capability >= 8.9, Ada or newer); "
            f"{name} has {capability[0]}.{capability[1]}"
        )


def fp8_eligible(module: nn.Module) -> bool:
    """Whether a module of a decoder block is converted: a linear layer with float8-friendly dims."""
    if not isinstance(module, nn.Linear):
        return False
    return module.in_features % FP8_ALIGN == 0 and module.out_features % FP8_ALIGN == 0


def apply_fp8(blocks: list[nn.Module], recipe: str, emulate: bool, fsdp_all_gather: bool) -> list[str]:
    """Convert the eligible linear layers of `blocks` (in place, before sharding and compilation) to torchao's
    Float8Linear under `recipe` ("tensorwise" or "rowwise"); returns the converted modules' names within a block,
    block by block. `fsdp_all_gather` all-gathers tensorwise weights in float8 under FSDP2."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise"
    )
    converted: list[str] = []
    for i, block in enumerate(blocks):

        def keep(module: nn.Module, name: str, block_index: int = i) -> bool:
            ok = fp8_eligible(module)
            if ok:
                converted.append(f"{block_index}.{name}")
            return ok

        float8.convert_to_float8_training(block, module_filter_fn=keep, config=config)
    return converted


def _rowwise(config: Any) -> bool:
    """Whether a Float8LinearConfig scales per row (axiswise) rather than per tensor."""
    return "AXISWISE" in str(config.cast_config_input.scaling_granularity)


def casts_tensorwise(module: nn.Module) -> bool:
    """Whether `module` is a float8 linear layer under the tensorwise recipe: under tensor parallelism its input is
    cast to float8 before the all-gather and its layer split by torchao's float8 styles (`float8_tp_styles`)."""
    return type(module).__name__ == "Float8Linear" and not _rowwise(module.config)


def float8_tp_styles() -> tuple[type, type, type]:
    """torchao's tensor-parallel styles for tensorwise float8 layers: column-wise, row-wise, and the input
    preparation that casts a module's input to float8 once, before its all-gather (half the bytes of bf16), for
    every float8 layer that reads it."""
    _torchao_float8()  # the quiet import, with its errors
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def fp8_layers(model: nn.Module) -> list[nn.Module]:
    """The model's float8 linear layers (none without `model.fp8`)."""
    return [m for m in model.modules() if type(m).__name__ == "Float8Linear"]


def describe_fp8(model: nn.Module) -> str:
    """One phrase for the rank log: the recipe and how many linear layers run in FP8 (empty without FP8)."""
    layers = fp8_layers(model)
    if not layers:
        return ""
    config = layers[0].config
    kind = "rowwise" if _rowwise(config) else "tensorwise"
    extra = ", emulated" if config.emulate else ""
    extra += ", float8 all-gather" if config.enable_fsdp_float8_all_gather else ""
    return f"fp8 {kind} on {len(layers)} linear layers{extra}"


def uses_fp8_all_gather(model: nn.Module) -> bool:
    """Whether any layer of `model` all-gathers its weight in float8 (then `precompute_fp8_scales` is due after
    every optimizer step)."""
    return any(m.config.enable_fsdp_float8_all_gather for m in fp8_layers(model))


def precompute_fp8_scales(model: nn.Module) -> None:
    """Compute the float8 scales of every FSDP-sharded float8 weight at once (one all-reduce for all of them)
    after an optimizer step, instead of one per layer in the next forward."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
