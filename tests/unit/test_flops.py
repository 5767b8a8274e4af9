"""FLOPs, parameter counts and spike flags against hand counts."""

from __future__ import annotations

import torch

from lmforge.model import build_model
from lmforge.train.callbacks.spike_flags import SpikeDetector
from lmforge.train.flops import FlopCounter, attended_pairs, param_counts, peak_flops
from tests.conftest import tiny_llama

CPU = torch.device("cpu")

# tiny_llama: hidden 64, MLP 128, 2 layers, 4 query heads and 2 KV heads of 16 dims; vocabulary 256.
PER_LAYER = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k, v, o, gate, up, down = 36,864
HEAD = 256 * 64


def test_step_flops_equal_a_hand_count_with_and_without_document_masking() -> None:
    for tied in (False, True):
        model = build_model(tiny_llama(tie_word_embeddings=tied), 256, "sdpa", CPU)
        counter = FlopCounter(model, layers=2, heads=4, head_dim=16)
        matmul = 2 * PER_LAYER + HEAD  # a tied head still multiplies
        assert counter.matmul == matmul == 90_112
        masked = attended_pairs([torch.tensor([30, 70], dtype=torch.int32)])
        whole = attended_pairs([torch.tensor([100], dtype=torch.int32)])
        assert (masked, whole) == (30 * 31 // 2 + 70 * 71 // 2, 100 * 101 // 2) == (2950, 5050)
        per_pair = 12 * 2 * 4 * 16  # layers x heads x head_dim x (2 FLOPs QK + 2 FLOPs AV) x 3 (fwd + bwd)
        assert counter.step_flops(100, masked) == (6 * matmul * 100 + per_pair * 2950, 6 * matmul * 100)
        assert counter.step_flops(100, whole)[0] - counter.step_flops(100, masked)[0] == per_pair * (5050 - 2950)


def test_parameter_counts() -> None:
    untied = param_counts(build_model(tiny_llama(), 256, "sdpa", CPU))
    norms = 2 * 2 * 64 + 64  # two per layer, plus the final one
    embed = 256 * 64
    assert untied == {
        "params/total": embed + 2 * PER_LAYER + norms + HEAD,
        "params/embedding": embed,
        "params/non_embedding": 2 * PER_LAYER + norms + HEAD,
        "params/active_non_embedding": 2 * PER_LAYER + norms + HEAD,
    }
    tied = param_counts(build_model(tiny_llama(tie_word_embeddings=True), 256, "sdpa", CPU))
    assert tied["params/total"] == untied["params/total"] - HEAD and tied["params/embedding"] == embed


def test_peak_table_and_unknown_devices() -> None:
    import warnings

    import pytest

    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "NVIDIA H100 80GB HBM3") == peak_flops(cuda, "NVIDIA H200") == 989e12
    assert peak_flops(cuda, "NVIDIA H100 PCIe") == 756e12 and peak_flops(cuda, "NVIDIA A100-SXM4-80GB") == 312e12
    with pytest.warns(UserWarning, match="perf/mfu is not logged"):
        assert peak_flops(cuda, "NVIDIA Mystery 9000") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CPU has no MFU, silently
        assert peak_flops(CPU) is None


def test_spike_flags_fire_on_an_injected_spike_only() -> None:
    smooth = [3.0 * 0.99**i + 0.01 * ((-1) ** i) for i in range(300)]
    detector = SpikeDetector(factor=1.5, window=50)
    assert not any(detector.update(v) for v in smooth)
    with_spike = list(smooth)
    with_spike[200] = 2.5 * smooth[199]
    detector = SpikeDetector(factor=1.5, window=50)
    flags = [detector.update(v) for v in with_spike]
    assert [i for i, f in enumerate(flags) if f] == [200]
    assert SpikeDetector(2.0, 10).update(float("nan"))
