"""gpt-oss and DeepSeek-V3 train like one process under FSDP (2 processes) and under context x expert parallelism (2
processes: rows split 2 ways, experts 2 ways; with multi-token prediction, expert parallelism alone), and a run's
export loads in transformers with the logits lmforge computes. gpt-oss: sliding windows that documents both fit in
and cross, sinks, biased routers and experts. DeepSeek-V3: MLA (value heads narrower than the query/key heads,
through the CP gather), group-limited routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.config.arch import AnyArch
from lmforge.hf.folder import load_pretrained
from tests.conftest import arch_toml
from tests.integration.runner import TINY_ARCH, TINY_RUN, curve, exported_logits_gap, train_run
from tests.unit.test_moe import tiny_deepseek, tiny_gpt_oss

pytestmark = pytest.mark.slow

CP_EP = ("--parallel.cp", "2", "--parallel.ep", "2")
FAMILIES: dict[str, tuple[AnyArch, tuple[str, ...], tuple[str, ...]]] = {
    # documents of ~24 tokens, some under the 16-key window, some over it, cross the chunk boundaries of cp 2
    "gpt-oss": (tiny_gpt_oss(max_position_embeddings=256, sliding_window=16, swiglu_limit=1.0),
                ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias",
                 "model.layers.1.mlp.gate.bias"), CP_EP),
    "deepseek-v3": (tiny_deepseek(max_position_embeddings=256, q_lora_rank=24),
                    ("model.layers.0.self_attn.q_a_layernorm.weight",
                     "model.layers.1.mlp.gate.e_score_correction_bias"), CP_EP),
    # two multi-token-prediction depths (not under cp: they read tokens another rank may hold)
    "deepseek-v3-mtp": (tiny_deepseek(max_position_embeddings=256, num_nextn_predict_layers=2),
                        ("model.mtp_layers.1.enorm.weight", "model.mtp_layers.0.mlp.gate.e_score_correction_bias"),
                        ("--parallel.ep", "2")),
}  # fmt: skip
"""Each family's tiny model, parameters that start at zero (or one) and must have moved in training, and the
split layout it trains under besides FSDP."""


@pytest.mark.parametrize(
    "family",
    # MLA under cp x ep in long mode: CI trains MLA with MTP at ep 2, and checks MLA's values through a CP group
    # in tests/unit/test_context_parallel.py
    [pytest.param(f, marks=pytest.mark.long) if f == "deepseek-v3" else f for f in FAMILIES],
)
def test_trains_like_one_process_under_fsdp_cp_and_ep_and_exports(family: str, tmp_path: Path) -> None:
    arch, moved, layout = FAMILIES[family]
    cfg = tmp_path / f"{family}.toml"
    run = TINY_RUN.format(max_steps=3, output_dir=(tmp_path / "unused").as_posix()).replace(TINY_ARCH, arch_toml(arch))
    cfg.write_text(run + "\n[model.moe_balance]\ncoeff = 0.01\n")
    one = train_run(cfg, tmp_path / "one", nproc=1)
    runs = {
        "dp2": train_run(cfg, tmp_path / "dp2", nproc=2),
        "split": train_run(cfg, tmp_path / "split", *layout, nproc=2),
    }
    mtp = [f"loss/mtp/{k}" for k in range(1, getattr(arch, "num_nextn_predict_layers", 0) + 1)]
    for key in ("loss/mean", "optim/grad_norm", "loss/tokens", *mtp):
        want = curve(one, key)
        assert len(want) == 3
        for name, run_dir in runs.items():
            assert curve(run_dir, key) == pytest.approx(want, rel=1e-5, abs=1e-6), (name, key)

    model, _ = load_pretrained(runs["split"])
    state = model.state_dict()
    for name in moved:
        start = 1.0 if name.endswith("norm.weight") else 0.0
        assert (state[name] != start).any(), name
    assert exported_logits_gap(runs["split"], model, tmp_path / "hf") <= 1e-5
