"""gpt-oss trains like one process under FSDP (2 processes) and under context x expert parallelism (2 processes:
rows split 2 ways, experts 2 ways), with sliding windows that documents both fit in and cross, sinks, and biased
routers and experts; the run's export loads in transformers with the logits lmforge computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.hf.folder import load_pretrained
from tests.conftest import arch_toml
from tests.integration.runner import TINY_ARCH, TINY_RUN, curve, exported_logits_gap, train_run
from tests.unit.test_moe import tiny_gpt_oss

pytestmark = pytest.mark.slow


def test_gpt_oss_trains_like_one_process_under_fsdp_cp_and_ep(tmp_path: Path) -> None:
    # Documents of ~24 tokens (some under the 16-key window, some over it) cross the chunk boundaries of cp 2.
    arch = tiny_gpt_oss(max_position_embeddings=256, sliding_window=16, swiglu_limit=1.0)
    cfg = tmp_path / "gpt-oss.toml"
    cfg.write_text(TINY_RUN.format(max_steps=3, output_dir=(tmp_path / "unused").as_posix()).replace(
        TINY_ARCH, arch_toml(arch)))  # fmt: skip
    one = train_run(cfg, tmp_path / "one", nproc=1)
    runs = {
        "dp2": train_run(cfg, tmp_path / "dp2", nproc=2),
        "cp2ep2": train_run(cfg, tmp_path / "cp2ep2", "--parallel.cp", "2", "--parallel.ep", "2", nproc=2),
    }
    for key in ("loss/mean", "optim/grad_norm", "loss/tokens"):
        want = curve(one, key)
        assert len(want) == 3
        for name, run in runs.items():
            assert curve(run, key) == pytest.approx(want, rel=1e-5, abs=1e-6), (name, key)

    # The sinks and biases trained (they start at zero), and the export of the split run is what transformers runs.
    model, _ = load_pretrained(runs["cp2ep2"])
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias",
                 "model.layers.1.mlp.gate.bias"):  # fmt: skip
        assert model.get_parameter(name).abs().max() > 0, name
    assert exported_logits_gap(runs["cp2ep2"], model, tmp_path / "hf") <= 1e-5
