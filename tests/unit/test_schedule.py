"""The WSD learning-rate multiplier."""

from __future__ import annotations

import itertools
import math

import pytest

from lmforge.config import ScheduleConfig
from lmforge.optim import wsd_multiplier


def curve(max_steps: int, **fields: object) -> list[float]:
    cfg = ScheduleConfig(**fields)
    return [wsd_multiplier(s, max_steps, cfg) for s in range(1, max_steps + 1)]


def test_warmup_stable_linear_decay() -> None:
    values = curve(10, warmup=0.2, decay=0.4, end_ratio=0.0, decay_shape="linear")
    assert values == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_decay_shapes_reach_end_ratio_at_last_step() -> None:
    for shape in ("linear", "cosine", "sqrt"):
        values = curve(100, warmup=0.0, decay=0.5, end_ratio=0.1, decay_shape=shape)
        assert values[49] == 1.0  # last stable step
        assert values[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in itertools.pairwise(values[50:]))  # monotone decay


def test_shape_values_at_midpoint() -> None:
    mid = {
        shape: curve(100, warmup=0.0, decay=1.0, end_ratio=0.0, decay_shape=shape)[49]
        for shape in ("linear", "cosine", "sqrt")
    }
    assert mid["linear"] == pytest.approx(0.5)
    assert mid["cosine"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert mid["sqrt"] == pytest.approx(1 - math.sqrt(0.5))


def test_constant_when_no_warmup_or_decay() -> None:
    assert curve(5, warmup=0.0, decay=0.0) == [1.0] * 5


def test_fractions_must_fit() -> None:
    with pytest.raises(ValueError, match="must not exceed 1"):
        ScheduleConfig(warmup=0.6, decay=0.5)
