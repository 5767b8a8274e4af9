"""Two options off by default: ReLU-squared MLPs (`hidden_act = "relu2"` on Llama and Qwen3), which export to
transformers with the same logits and which the families that cannot honour them refuse by name; and zero-initialized
residual-branch output projections (`model.init.zero_out_proj`), which leave every other parameter's init bit for
bit as it is, on any layout, and move on the first training step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from lmforge.config import ConfigError, load_train_config
from lmforge.config.arch import AnyArch, LlamaArch, Qwen3Arch
from lmforge.config.hf_config import HFModelError, read_hf_config
from lmforge.config.optim import AdamWConfig
from lmforge.model import build_model
from lmforge.model.completep import role_scales
from lmforge.model.init import init_weights, output_projections
from lmforge.model.llama import CausalLM
from lmforge.model.mlp import MLP
from lmforge.model.roles import param_role
from lmforge.optim import build_optimizer
from tests.conftest import tiny_llama, tiny_qwen3
from tests.integration.runner import write_config
from tests.spawn import free_port, join_as_rank, run_ranks
from tests.unit.test_hf import (
    VOCAB,
    _export,
    _from_pretrained,
    _ids,
    _lmforge,
    _logits,
    assert_config_like_transformers,
    write_hf_config,
)
from tests.unit.test_moe import tiny_deepseek, tiny_glm, tiny_gpt_oss, tiny_qwen3_moe

CPU = torch.device("cpu")


# ReLU-squared MLPs


def test_mlp_computes_the_reference_formulas() -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 16)
    silu, relu2 = MLP(16, 24), MLP(16, 24, "relu2")
    relu2.load_state_dict(silu.state_dict())
    gate, up, down = silu.gate_proj.weight, silu.up_proj.weight, silu.down_proj.weight
    with torch.no_grad():
        # SwiGLU exactly as before the option existed; ReLU squared as transformers' ACT2FN["relu2"] computes it
        assert torch.equal(silu(x), F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))
        g = F.linear(x, gate)
        want = F.linear(torch.where(g > 0, g * g, torch.zeros_like(g)) * F.linear(x, up), down)
        torch.testing.assert_close(relu2(x), want, rtol=0, atol=1e-7)
        assert not torch.allclose(relu2(x), silu(x), atol=1e-3)
    with pytest.raises(ValueError, match="'gelu'"):
        MLP(16, 24, "gelu")  # type: ignore[arg-type]


def test_hidden_act_reaches_every_dense_mlp() -> None:
    model = build_model(tiny_qwen3(hidden_act="relu2"), VOCAB, "sdpa", CPU)
    assert [layer.mlp.act for layer in model.model.layers] == ["relu2", "relu2"]
    assert build_model(tiny_llama(), VOCAB, "sdpa", CPU).model.layers[0].mlp.act == "silu"
    # the MoE families keep SwiGLU in their dense layers and shared experts
    glm = build_model(tiny_glm(), VOCAB, "sdpa", CPU)
    assert {m.act for m in glm.modules() if isinstance(m, MLP)} == {"silu"}


@pytest.mark.parametrize(
    "arch", [tiny_llama(hidden_act="relu2"), tiny_qwen3(hidden_act="relu2")], ids=["llama", "qwen3"]
)
def test_relu2_export_loads_in_transformers_with_equal_logits(arch: LlamaArch | Qwen3Arch, tmp_path: Path) -> None:
    model = _lmforge(arch)
    _export(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_act"] == "relu2"
    hf = _from_pretrained(tmp_path / "out")
    assert hf.config.hidden_act == "relu2"
    ids = _ids()
    ours = _logits(model, ids, hf=False)
    assert (ours - _logits(hf, ids, hf=True)).abs().max().item() <= 1e-4
    # the same weights under SwiGLU give other logits: the activation is what was compared
    silu = build_model(arch.model_copy(update={"hidden_act": "silu"}), VOCAB, "sdpa", CPU).eval()
    silu.load_state_dict(model.state_dict())
    assert (ours - _logits(silu, ids, hf=False)).abs().max().item() > 1e-2
    # the folder reads back to a ReLU-squared model, and transformers resaves the config as lmforge writes it
    assert read_hf_config(tmp_path / "out").arch.hidden_act == "relu2"
    assert_config_like_transformers(arch, tmp_path, dropped=("rope_theta",))


def test_hf_import_takes_relu2_only_where_lmforge_computes_it(tmp_path: Path) -> None:
    assert read_hf_config(write_hf_config(tmp_path / "qwen3", hidden_act="relu2")).arch.hidden_act == "relu2"
    assert read_hf_config(write_hf_config(tmp_path / "llama", tiny_llama())).arch.hidden_act == "silu"
    assert read_hf_config(write_hf_config(tmp_path / "absent", hidden_act=None)).arch.hidden_act == "silu"
    folder = write_hf_config(tmp_path / "glm", tiny_glm(), hidden_act="relu2")
    with pytest.raises(HFModelError, match=r"hidden_act 'relu2' is not supported for model_type 'glm4_moe'"):
        read_hf_config(folder)
    with pytest.raises(HFModelError, match=r"hidden_act 'gelu'"):
        read_hf_config(write_hf_config(tmp_path / "gelu", hidden_act="gelu"))


@pytest.mark.parametrize("family", [tiny_qwen3_moe, tiny_glm, tiny_gpt_oss, tiny_deepseek],
                         ids=["qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3"])  # fmt: skip
def test_families_that_cannot_honour_hidden_act_refuse_it_by_name(family: Callable[..., AnyArch],
                                                                  tmp_path: Path) -> None:  # fmt: skip
    with pytest.raises(ValidationError, match="hidden_act"):
        family(hidden_act="relu2")
    assert family().mlp_act == "silu"
    path = write_config(tmp_path, "moe", arch=family())
    with pytest.raises(ConfigError, match=r"model\.arch\.hidden_act"):
        load_train_config(["@", str(path), "--model.arch.hidden_act", "relu2"], 1)


def test_run_configs_take_both_options(tmp_path: Path) -> None:
    path = write_config(tmp_path, "run")
    config, _ = load_train_config(["@", str(path), "--model.arch.hidden_act", "relu2", "--model.init.zero_out_proj",
                                "true"], 1)  # fmt: skip
    assert config.model.arch is not None and config.model.arch.mlp_act == "relu2"
    assert config.model.init.zero_out_proj
    plain, _ = load_train_config(["@", str(path)], 1)
    assert plain.model.arch is not None and plain.model.arch.mlp_act == "silu" and not plain.model.init.zero_out_proj


# Zero-initialized output projections

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
          "mlp.experts.down_proj", "latent_up_proj.weight")  # fmt: skip
"""The names, written out independently of `output_projections`, of the last matrix of each residual branch."""

ARCHS = {
    "llama": tiny_llama(),
    "qwen3-relu2": tiny_qwen3(hidden_act="relu2"),
    "glm-shared": tiny_glm(n_shared_experts=2),
    "glm-latent-hc": tiny_glm(moe_latent_size=32, hyper_connections=2),
    "gpt_oss": tiny_gpt_oss(),
    "deepseek-mtp": tiny_deepseek(num_nextn_predict_layers=1),
}


def _expected_zeroed(model: nn.Module) -> set[str]:
    names = {n for n, _ in model.named_parameters()}
    latent = any("latent_up_proj" in n for n in names)
    return {n for n in names if n.endswith(ZEROED) and not (latent and n.endswith("experts.down_proj"))}


def _init(arch: AnyArch, zero_out_proj: bool, completep: bool = False) -> CausalLM:
    model = build_model(arch, VOCAB, "sdpa", CPU)
    stds = None
    if completep:
        scale = role_scales(arch, "completep", arch.hidden_size // 2, 1)
        stds = {n: scale(param_role(n, p.ndim)).init_std for n, p in model.named_parameters()}
    init_weights(model, 0.02, seed=5, truncate=completep, std_scales=stds, zero_out_proj=zero_out_proj)
    return model


@pytest.mark.parametrize("key", list(ARCHS))
def test_only_the_output_projections_change(key: str) -> None:
    arch = ARCHS[key]
    completep = key == "llama"  # CompleteP's per-role stds and truncation leave the other draws alone too
    plain, zeroed = _init(arch, False, completep), _init(arch, True, completep)
    expected = _expected_zeroed(plain)
    assert set(output_projections(plain)) == expected
    kinds = {suffix for suffix in ZEROED if any(n.endswith(suffix) for n in expected)}
    assert "self_attn.o_proj.weight" in kinds
    if key.startswith("glm-latent"):
        assert "latent_up_proj.weight" in kinds and "mlp.experts.down_proj" not in kinds
    elif arch.moe is not None:
        assert "mlp.experts.down_proj" in kinds
    reference = dict(plain.named_parameters())
    for name, param in zeroed.named_parameters():
        if name in expected:
            assert not param.any() and reference[name].abs().sum() > 0, name
        else:
            assert torch.equal(param, reference[name]), name


def test_every_block_starts_as_the_identity() -> None:
    model = _init(tiny_llama(), True)
    ids = _ids()
    with torch.no_grad():
        want = model.lm_head(model.model.norm(model.model.embed_tokens(ids)))
        torch.testing.assert_close(_logits(model, ids, hf=False), want, rtol=0, atol=1e-6)
        assert not torch.allclose(_logits(_init(tiny_llama(), False), ids, hf=False), want, atol=1e-3)


@pytest.mark.parametrize("key", ["llama", "glm-shared", "glm-latent-hc"])
def test_the_first_step_moves_the_zeroed_projections(key: str, one_thread: None) -> None:
    model = _init(ARCHS[key], True)
    zeroed = set(output_projections(model))
    opt = build_optimizer(model, AdamWConfig(lr=1e-3, weight_decay=0.1, max_norm=0))
    for step in range(2):
        ids = _ids(seed=step, t=48)
        targets = torch.roll(ids, -1, dims=1)
        model(ids, torch.arange(48)[None], torch.tensor([20, 28]), targets=targets).backward()
        params = dict(model.named_parameters())
        if step == 0:
            for name in zeroed:
                grad = params[name].grad
                assert grad is not None and grad.abs().sum() > 0, name
        opt.step()
        opt.zero_grad()
    for name, param in model.named_parameters():
        if name in zeroed:
            assert param.abs().sum() > 0, name


def test_sharded_parameters_are_zeroed_in_place() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lmforge.parallel.process_group import init_distributed

    ctx = init_distributed()  # a process group of one, as a plain `lmforge train` starts
    arch = tiny_glm(n_shared_experts=1)
    model = build_model(arch, VOCAB, "sdpa", CPU)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    init_weights(model, 0.02, seed=5, zero_out_proj=True)
    reference = dict(_init(arch, True).named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        assert torch.equal(param.full_tensor(), reference[name]), name


def _layout_worker(rank: int, port: int, tmp: str) -> None:
    """On two ranks: a tensor-parallel Llama with ReLU-squared MLPs and a fully sharded GLM MoE, each initialized
    with zero_out_proj after the split, hold the single-process init; the split ReLU-squared model computes the
    whole one's loss and gradients."""
    join_as_rank(rank, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lmforge.parallel.process_group import init_distributed, shutdown_distributed
    from lmforge.parallel.tensor import TensorShard, apply_tensor_parallel

    init_distributed(timeout_minutes=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    found: dict[str, float] = {}

    def full(p: torch.Tensor) -> torch.Tensor:
        return p.full_tensor() if isinstance(p, DTensor) else p

    arch = tiny_llama(hidden_act="relu2")
    whole = _init(arch, True)
    split = build_model(arch, VOCAB, "sdpa", CPU)
    apply_tensor_parallel(split, TensorShard(mesh, rank, 2))
    init_weights(split, 0.02, seed=5, zero_out_proj=True)
    reference = dict(whole.named_parameters())
    found["tp/init"] = float(all(torch.equal(full(p), reference[n]) for n, p in split.named_parameters()))
    zeroed = set(output_projections(whole))
    with torch.no_grad():  # non-zero projections, so that the activation shapes the loss and every gradient
        for model in (whole, split):
            for name, p in model.named_parameters():
                if name in zeroed:
                    p.add_(0.01)
    ids = _ids(t=64)
    doc_lens, targets = torch.tensor([30, 34]), torch.roll(ids, -1, dims=1)
    pos = torch.cat([torch.arange(30), torch.arange(34)])[None]
    want, got = whole(ids, pos, doc_lens, targets=targets), split(ids, pos, doc_lens, targets=targets)
    found["tp/loss"] = abs(got.item() - want.item()) / want.item()
    want.backward()
    got.backward()
    found["tp/grads"] = max(((full(p.grad) - reference[n].grad).abs().max() / reference[n].grad.abs().max()).item()
                            for n, p in split.named_parameters())  # fmt: skip

    moe = tiny_glm(n_shared_experts=1)
    sharded = build_model(moe, VOCAB, "sdpa", CPU)
    fsdp_mesh = init_device_mesh("cpu", (2,))
    for block in sharded.blocks:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(sharded, mesh=fsdp_mesh)
    init_weights(sharded, 0.02, seed=5, zero_out_proj=True)
    reference = dict(_init(moe, True).named_parameters())
    found["fsdp/init"] = float(all(torch.equal(full(p), reference[n]) for n, p in sharded.named_parameters()))
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(found))
    shutdown_distributed()


@pytest.mark.slow
def test_two_rank_layouts_init_alike_and_relu2_splits(tmp_path: Path) -> None:
    for found in run_ranks(_layout_worker, (free_port(), str(tmp_path)), tmp_path, timeout=240):
        assert found["tp/init"] == 1.0 and found["fsdp/init"] == 1.0, found
        assert found["tp/loss"] < 1e-5 and found["tp/grads"] < 1e-5, found


def test_a_training_run_starts_from_the_zeroed_projections(tmp_path: Path) -> None:
    """The trainer's from-scratch init honours `model.init.zero_out_proj` (and only the projections change)."""
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed
    from lmforge.train.trainer import Trainer
    from tests.unit.test_micro_batches import train_config

    ctx = init_distributed()
    try:
        weights = {}
        for zero in (False, True):
            model = {"arch": tiny_llama().model_dump(), "init": {"zero_out_proj": zero}}
            trainer = Trainer(train_config(tmp_path / str(zero), model=model), ctx, console=False)
            weights[zero] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            trainer.close()
    finally:
        shutdown_distributed()
    zeroed = {n for n, p in weights[True].items() if n.endswith(("o_proj.weight", "down_proj.weight"))}
    assert len(zeroed) == 2 * tiny_llama().num_hidden_layers
    for name, p in weights[True].items():
        if name in zeroed:
            assert not p.any() and weights[False][name].any(), name
        else:
            assert torch.equal(p, weights[False][name]), name


def test_lr_multipliers_scale_their_roles_only() -> None:
    """`optim.lr_multipliers` multiplies the named roles' peak lr (Muon's and AdamW's groups alike), on top of
    CompleteP's factors; an unknown role is an error naming the field and the roles."""
    from lmforge.config.optim import MuonConfig

    model = build_model(tiny_llama(), VOCAB, "sdpa", CPU)
    plain = {g["name"]: g["lr"] for g in build_optimizer(model, MuonConfig(lr=0.01, adamw_lr=0.002)).param_groups}
    cfg = MuonConfig(lr=0.01, adamw_lr=0.002, lr_multipliers={"embed": 4.0, "hidden": 0.5})
    scaled = {g["name"]: g["lr"] for g in build_optimizer(model, cfg).param_groups}
    assert plain["embed"] == 0.002 and plain["hidden"] == 0.01
    assert scaled == {**plain, "embed": 0.008, "hidden": 0.005}
    arch = tiny_llama()
    completep = role_scales(arch, "completep", arch.hidden_size // 2, arch.num_hidden_layers)
    both = {g["name"]: g["lr"] for g in build_optimizer(model, cfg, completep).param_groups}
    base = MuonConfig(lr=0.01, adamw_lr=0.002)
    alone = {g["name"]: g["lr"] for g in build_optimizer(model, base, completep).param_groups}
    assert alone["embed"] != plain["embed"] or alone["hidden"] != plain["hidden"]  # CompleteP moves some lr
    assert both["embed"] == pytest.approx(alone["embed"] * 4) and both["hidden"] == pytest.approx(alone["hidden"] / 2)
    with pytest.raises(ConfigError, match=r"optim.lr_multipliers: unknown role\(s\) \['embeddings'\]; the roles"):
        build_optimizer(model, MuonConfig(lr=0.01, lr_multipliers={"embeddings": 2.0}))
