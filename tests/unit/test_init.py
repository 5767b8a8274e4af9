"""Sharding-independent init: the same values on any world size and layout, declared 1-D rules, truncation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from lmforge.config.arch import Glm4MoeArch
from lmforge.model import build_model
from lmforge.model.init import ROWS_PER_BLOCK, init_weights, normal_rows
from tests.conftest import tiny_llama
from tests.integration.runner import cli_command, env_one_thread

CPU = torch.device("cpu")


@pytest.mark.parametrize("cut", [1, 7, ROWS_PER_BLOCK, ROWS_PER_BLOCK + 3, 150])
def test_rows_drawn_in_pieces_equal_rows_drawn_whole(cut: int) -> None:
    shape = (300, 24)
    whole = normal_rows("w", shape, 0, 300, 0.02, seed=1)
    pieces = torch.cat([normal_rows("w", shape, 0, cut, 0.02, 1), normal_rows("w", shape, cut, 300 - cut, 0.02, 1)])
    assert torch.equal(whole, pieces)
    assert not torch.equal(whole, normal_rows("w", shape, 0, 300, 0.02, seed=2))
    assert not torch.equal(whole, normal_rows("v", shape, 0, 300, 0.02, seed=1))


def test_truncated_values_stay_within_three_std() -> None:
    values = normal_rows("w", (2000, 50), 0, 2000, 0.5, seed=0, truncate=True)
    assert values.abs().max() <= 1.5 and 0.4 < values.std() < 0.5  # truncation narrows the std a little
    assert normal_rows("w", (2000, 50), 0, 2000, 0.5, seed=0).abs().max() > 1.5


@pytest.mark.slow
def test_world_size_one_and_two_give_bitwise_identical_weights(tmp_path: Path) -> None:
    script = Path(__file__).with_name("init_ranks.py")
    for nproc, out in ((1, tmp_path / "ws1"), (2, tmp_path / "ws2")):
        out.mkdir()
        cmd = cli_command([str(out)], nproc=nproc, script=script)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env_one_thread(), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    plain = build_model(tiny_llama(intermediate_size=136), 200, "sdpa", CPU)
    init_weights(plain, 0.02, seed=7, truncate=True)
    expected = dict(plain.named_parameters())
    for path in [tmp_path / "ws1" / "rank_0.pt", tmp_path / "ws2" / "rank_0.pt", tmp_path / "ws2" / "rank_1.pt"]:
        got = torch.load(path)
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[name]), f"{path}: {name}"


def _expert_reference(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """A whole expert stack drawn expert by expert, each expert's matrix in row blocks under its own name."""
    return torch.stack([normal_rows(f"{name}[{e}]", shape[1:], 0, shape[1], std, seed, truncate=True)
                        for e in range(shape[0])])  # fmt: skip


@pytest.mark.slow
def test_expert_stacks_init_per_expert_alike_on_any_ranks_and_ep(tmp_path: Path) -> None:
    from tests.unit.init_ranks import MOE

    script = Path(__file__).with_name("init_ranks.py")
    layouts = {"ws1": (1, 1), "ws2_ep2": (2, 2), "ws4_ep2": (4, 2)}
    for folder, (nproc, ep) in layouts.items():
        out = tmp_path / folder
        out.mkdir()
        cmd = cli_command([str(out), str(ep)], nproc=nproc, script=script)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env_one_thread(), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    plain = build_model(Glm4MoeArch(**MOE), 200, "sdpa", CPU)
    init_weights(plain, 0.02, seed=7, truncate=True)
    expected = dict(plain.named_parameters())
    stacks = [n for n in expected if ".experts." in n]
    assert len(stacks) == 2
    for name in stacks:
        assert torch.equal(expected[name], _expert_reference(name, tuple(expected[name].shape), 0.02, 7)), name
    for folder, (nproc, _) in layouts.items():
        for rank in range(nproc):
            got = torch.load(tmp_path / folder / f"rank_{rank}.pt")
            assert got.keys() == expected.keys()
            for name, tensor in got.items():
                assert torch.equal(tensor, expected[name]), f"{folder} rank {rank}: {name}"


class _Gate(nn.Module):
    def __init__(self, declare: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.selection_bias = nn.Parameter(torch.full((8,), 5.0))
        if declare:
            self.init_rules = {"selection_bias": "zero"}


def test_undeclared_one_dimensional_parameter_fails_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"'gate\.selection_bias'"):
        init_weights(nn.ModuleDict({"gate": _Gate(declare=False)}), 0.02, 0)
    declared = nn.ModuleDict({"gate": _Gate(declare=True)})
    init_weights(declared, 0.02, 0)
    assert torch.equal(declared["gate"].selection_bias, torch.zeros(8))


def test_std_scales_multiply_one_parameter() -> None:
    model = build_model(tiny_llama(), 256, "sdpa", CPU)
    init_weights(model, 0.02, 0, std_scales={"model.layers.0.mlp.down_proj.weight": 0.5})
    scaled = model.model.layers[0].mlp.down_proj.weight
    other = build_model(tiny_llama(), 256, "sdpa", CPU)
    init_weights(other, 0.02, 0)
    assert torch.equal(scaled, 0.5 * other.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)
