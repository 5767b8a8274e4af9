"""Training under expert parallelism equals training without it: per-step losses, gradient norms and the routing
biases with ep = 2 (2 processes), ep = 2 x 2 expert-FSDP ranks (4 processes), ep = 4 over cp = 2 x dp = 2 ranks,
and ep = 2 compiled with activation checkpointing match one process within 1e-5; checkpoints resume across ep sizes
(1 -> 2 -> 1); the exported model is the one ep = 1 exports and transformers loads it with the same logits;
pretrained weights load into an ep = 2 model unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.hf.folder import load_pretrained
from lmforge.monitor import read_metrics
from tests.integration.runner import curve, exported_logits_gap, run_cli, train_run
from tests.integration.test_moe_train import RUN

pytestmark = pytest.mark.slow


def _train(cfg: Path, out: Path, nproc: int, ep: int, *extra: str) -> Path:
    return train_run(cfg, out, "--parallel.ep", str(ep), *extra, nproc=nproc)


def test_ep_trains_like_one_process_resumes_across_ep_and_exports_the_same(tmp_path: Path) -> None:
    cfg = tmp_path / "moe.toml"
    cfg.write_text(RUN.format(out=tmp_path / "unused"))
    one = _train(cfg, tmp_path / "one", 1, 1)
    runs = {
        "ep2": _train(cfg, tmp_path / "ep2", 2, 2),
        "ep2x2": _train(cfg, tmp_path / "ep2x2", 4, 2),
        # EP groups span context-parallel ranks too: 4 ranks, rows split 2 ways, experts 4 ways.
        "cp2ep4": _train(cfg, tmp_path / "cp2ep4", 4, 4, "--parallel.cp", "2"),
    }
    for key in ("loss/mean", "optim/grad_norm", "max_vio/mean", "moe/bias/abs_mean"):
        want = curve(one, key)
        assert len(want) == 8, key
        for name, run in runs.items():
            assert curve(run, key) == pytest.approx(want, rel=1e-5, abs=1e-6), (name, key)
    # Parameter counts (and so MFU) count whole expert stacks.
    counts = [{k: v for k, v in read_metrics(r / "metrics.jsonl")[0].items() if k.startswith("params/")}
              for r in (one, *runs.values())]  # fmt: skip
    assert counts[0]["params/total"] > 0 and all(c == counts[0] for c in counts)
    # Compiled blocks with activation checkpointing: the exchange runs outside the graphs and is recomputed in backward.
    compiled = _train(cfg, tmp_path / "compiled", 2, 2, "--model.compile", "--model.ac.mode", "full")
    assert curve(compiled, "loss/mean") == pytest.approx(curve(one, "loss/mean"), rel=1e-5)
    # Each rank's experts computed the copies routed to them: the mean over ranks is the copies per rank.
    last = read_metrics(runs["ep2"] / "metrics.jsonl")[-1]
    assert last["moe/rank_load/mean"] == 1024 * 2 / 2 and last["moe/rank_load/max"] >= last["moe/rank_load/mean"]

    # ep 1 (2 processes) for steps 1-3, ep 2 for 4-6, ep 1 (one process) for 7-8, each resuming the previous one.
    keep = ("--ckpt.interval", "1", "--ckpt.keep-last", "8")
    _train(cfg, tmp_path / "a", 2, 1, *keep)
    _train(cfg, tmp_path / "b", 2, 2, *keep, "--resume.step", "3", "--resume.path", str(tmp_path / "a"))
    _train(cfg, tmp_path / "c", 1, 1, "--resume.step", "6", "--resume.path", str(tmp_path / "b"))
    chained = [*curve(tmp_path / "a", "loss/mean")[:3], *curve(tmp_path / "b", "loss/mean")[:3],
               *curve(tmp_path / "c", "loss/mean")]  # fmt: skip
    assert chained == pytest.approx(curve(one, "loss/mean"), rel=1e-5)

    # The export of an ep = 2 run holds whole expert stacks: the model of the ep = 1 run, up to float rounding.
    want, _ = load_pretrained(one)
    got, _ = load_pretrained(runs["ep2"])
    mine = dict(got.state_dict())
    for name, tensor in want.state_dict().items():
        assert torch.allclose(mine[name], tensor, rtol=1e-4, atol=1e-5), name
    folder = tmp_path / "hf"
    assert exported_logits_gap(runs["ep2"], got, folder) <= 1e-4

    # Pretrained weights load into an ep = 2 model as they are (lr 1e-30 and no bias rule change no fp32 weight).
    again = _train(cfg, tmp_path / "from_hf", 2, 2, "--model.name", str(folder), "--optim.lr", "1e-30",
                   "--model.moe-balance.coeff", "0", "--max-steps", "1")  # fmt: skip
    back = tmp_path / "back"
    assert run_cli(["export", str(again), "--output", str(back), "--dtype", "float32"]).returncode == 0
    original, exported = load_file(folder / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
