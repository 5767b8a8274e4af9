"""The GPUs a plan can target: memory, peak bf16 FLOP/s and bandwidths, from the vendors' data sheets.

The peak FLOP/s are the ones `perf/mfu` divides by in a real run (`lmforge.train.flops.PEAK_BF16_FLOPS`), so a
plan's MFU and a run's are the same ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.train.flops import PEAK_BF16_FLOPS

GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as a plan sees it."""

    name: str
    """The name used on the command line (`--gpu`)."""
    memory_gib: float
    """Memory a process can allocate (what `torch.cuda.mem_get_info` reports as total), GiB."""
    peak_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    hbm_bytes_s: float
    """Memory bandwidth, bytes/s."""
    intra_node_bytes_s: float
    """Bandwidth of one GPU to the others of its node (NVLink, one direction), bytes/s."""
    inter_node_bytes_s: float
    """Bandwidth of one GPU to other nodes (its share of the network; one 400 Gb/s NIC per GPU by default), bytes/s."""
    fp8: bool
    """Whether it has FP8 tensor cores (compute capability >= 8.9)."""


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 79.1, PEAK_BF16_FLOPS["H100"], 3.35e12, 450e9, 50e9, True),
    "h200": GpuSpec("h200", 139.8, PEAK_BF16_FLOPS["H200"], 4.8e12, 450e9, 50e9, True),
    "a100": GpuSpec("a100", 79.1, PEAK_BF16_FLOPS["A100"], 2.04e12, 300e9, 25e9, False),
    "a100-40gb": GpuSpec("a100-40gb", 39.4, PEAK_BF16_FLOPS["A100"], 1.56e12, 300e9, 25e9, False),
    "b200": GpuSpec("b200", 178.4, PEAK_BF16_FLOPS["B200"], 8.0e12, 900e9, 50e9, True),
}
"""The GPUs `--gpu` accepts, by name."""


def gpu_spec(name: str) -> GpuSpec:
    """The spec of `--gpu NAME`; a ValueError lists the known names."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown --gpu {name!r}; expected one of {', '.join(GPUS)}") from None
