"""The rotary frequencies of an architecture: plain RoPE, or scaled for a longer context (`arch.rope_scaling`).

Each kind computes what transformers' RoPE initialisers compute for the same config, operation for operation in
fp32, so exported models give the same cos and sin tables. Everything is built on the target device from Python
numbers: no host copy or read per forward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lmforge.config.arch import AnyArch
from lmforge.config.rope import RopeScaling


def rotary_frequencies(arch: AnyArch, device: torch.device) -> tuple[Tensor, float]:
    """(inverse frequencies [arch.rotary_dim / 2] in fp32, the factor on cos and sin) of the architecture's RoPE."""
    dim, base = arch.rotary_dim, arch.rope_theta
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    scaling = arch.rope_scaling
    if scaling is None:
        return 1.0 / base**exponents, 1.0
    if scaling.rope_type == "linear":
        return 1.0 / base**exponents / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(1.0 / base**exponents, scaling), 1.0
    return _yarn(base**exponents, dim, base, scaling)


def _llama3(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor divided by the factor, shorter than original /
    high_freq_factor kept, and a linear blend of the two (in the original context's turns) in between."""
    original = scaling.original_max_position_embeddings
    assert original is not None  # the config requires it for llama3
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """YaRN's factor on cos and sin: the configured one, else 0.1 ln(factor) + 1 (over the same with
    mscale_all_dim in place of 1 when mscale and mscale_all_dim are both set)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """0.1 mscale ln(factor) + 1 (1 for factor <= 1): YaRN's temperature for a context `factor` times longer."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(pos_freqs: Tensor, dim: int, base: float, scaling: RopeScaling) -> tuple[Tensor, float]:
    """YaRN: each frequency a blend of itself (extrapolated) and itself / factor (interpolated), by a ramp over the
    dimensions whose turns across the original context fall between beta_slow and beta_fast."""
    original = scaling.original_max_position_embeddings
    assert original is not None  # the config requires it for yarn

    def dimension_of(turns: float) -> float:
        # The dimension whose frequency makes `turns` full turns over the original context.
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, device=pos_freqs.device, dtype=torch.float32) - low) / (high - low),
                       0, 1)  # fmt: skip
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, yarn_attention_factor(scaling)
