"""Hyper-connections (Zhu et al., arXiv 2409.19606) of the GLM-4.5 family: one sub-layer's hyper-connection equals
the paper's equations token by token, the paper's init makes the model equal the one without, every new parameter
learns, is initialized, trained by AdamW and counted, cached generation equals the training forward, and a model
with them exports as `lmforge_moe` and loads back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from lmforge.config.hf_config import RESEARCH_MODEL_TYPE, arch_to_hf_config, read_hf_config
from lmforge.config.optim import AdamWConfig, MuonConfig
from lmforge.hf.folder import load_pretrained
from lmforge.model import build_model
from lmforge.model.completep import role_scales
from lmforge.model.generate import KVCache, forward_with_cache
from lmforge.model.hyper_connections import HyperConnection
from lmforge.model.init import declared_init_rules, init_role, init_weights
from lmforge.model.llama import CausalLM
from lmforge.model.norm import RMSNorm
from lmforge.model.params import count_params
from lmforge.model.roles import param_role
from lmforge.optim import build_optimizer
from lmforge.parallel.fsdp import apply_activation_checkpointing
from tests.unit.test_moe import tiny_glm
from tests.unit.test_moe_export import VOCAB, _export, _ids, _lmforge, _logits

CPU = torch.device("cpu")
HIDDEN = 16


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _randomize(module: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    """Move every hyper-connection parameter of `module` away from its init (so no weight is 0, 1 or one-hot)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if isinstance(module, HyperConnection) or param_role(name, param.ndim) == "hyper":
                param.add_(scale * torch.randn(param.shape, generator=gen))


def _hc_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".attn_hc." in n or ".mlp_hc." in n}


@pytest.mark.parametrize("dynamic", [False, True], ids=["shc", "dhc"])
@pytest.mark.parametrize("rate", [2, 4])
def test_one_sub_layer_equals_the_papers_equations_per_token(rate: int, dynamic: bool) -> None:
    eps = 1e-5
    hc = HyperConnection(rate, HIDDEN, 3, RMSNorm(HIDDEN, eps) if dynamic else None)
    init_weights(hc, 0.02, seed=0)
    _randomize(hc, seed=1)
    gen = torch.Generator().manual_seed(2)
    stream = torch.randn(rate, 5, HIDDEN, generator=gen)
    w = torch.randn(HIDDEN, HIDDEN, generator=gen) / 4

    def branch(x: Tensor) -> Tensor:  # any per-token function stands in for attention or the MLP
        return torch.tanh(x @ w) + x.square()

    with torch.no_grad():
        got = hc(stream, branch)
        for t in range(5):
            h = stream[:, t]  # H [n, hidden]
            a_m, a_r, b = hc.static_alpha[:, 0], hc.static_alpha[:, 1:], hc.static_beta
            if dynamic:
                h_bar = _rms(h, hc.norm.weight, eps)
                w_m, w_r, w_beta = hc.alpha_proj[0], hc.alpha_proj[1:].T, hc.beta_proj  # [d], [d, n], [d]
                a_m = a_m + hc.alpha_scale * torch.tanh(h_bar @ w_m)
                a_r = a_r + hc.alpha_scale * torch.tanh(h_bar @ w_r)
                b = b + hc.beta_scale * torch.tanh(h_bar @ w_beta)
            layer_in = a_m @ h  # A_m^T H
            want = torch.outer(b, branch(layer_in[None])[0]) + a_r.T @ h  # B^T T(h_0) + A_r^T H
            torch.testing.assert_close(got[:, t], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["shc", "dhc"])
@pytest.mark.parametrize("rate", [1, 2, 4])
def test_at_init_the_model_equals_the_one_without(rate: int, dynamic: bool) -> None:
    plain = build_model(tiny_glm(), VOCAB, "sdpa", CPU)
    init_weights(plain, 0.05, seed=3)
    hyper = build_model(tiny_glm(hyper_connections=rate, hyper_connections_dynamic=dynamic), VOCAB, "sdpa", CPU)
    init_weights(hyper, 0.05, seed=3)
    state = hyper.state_dict()
    assert set(state) - set(plain.state_dict()) == set(_hc_params(hyper))
    assert all(torch.equal(value, state[name]) for name, value in plain.state_dict().items())
    ids = _ids()
    finals: list[Tensor] = []
    for model in (plain, hyper):
        hook = model.model.norm.register_forward_hook(lambda m, args, out: finals.append(args[0]))
        logits = _logits(model, ids, hf=False)
        hook.remove()
        finals.append(logits)
    # The n copies all hold the plain residual stream: their sum is n times it; the final RMSNorm removes the
    # factor up to its epsilon.
    torch.testing.assert_close(finals[2], rate * finals[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(finals[3], finals[1], atol=1e-3, rtol=0)
    if rate == 1:
        assert torch.equal(finals[3], finals[1])


def test_every_hyper_connection_parameter_gets_a_gradient() -> None:
    model = build_model(tiny_glm(hyper_connections=2), VOCAB, "sdpa", CPU)
    init_weights(model, 0.05, seed=0)
    params = _hc_params(model)
    ids, lens = _ids(), torch.tensor([20, 28], dtype=torch.int32)
    model(ids, torch.arange(48)[None], lens).float().logsumexp(-1).sum().backward()
    # At the paper's init the dynamic projections already learn (their scale is 0.01, not 0); the scales'
    # gradient is zero there (tanh(0) = 0), so perturb the init before checking all of them.
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in params.items() if n.endswith("_proj"))
    model.zero_grad()
    _randomize(model, seed=1, scale=0.05)
    model(ids, torch.arange(48)[None], lens).float().logsumexp(-1).sum().backward()
    assert len(params) == 3 * 2 * 7
    for name, param in params.items():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("dynamic", [False, True], ids=["shc", "dhc"])
def test_init_weights_sets_and_resets_the_papers_init(dynamic: bool) -> None:
    rate = 4
    model = build_model(tiny_glm(hyper_connections=rate, hyper_connections_dynamic=dynamic), VOCAB, "sdpa", CPU)
    rules = declared_init_rules(model)
    for name, param in model.named_parameters():  # every parameter has a rule (an undeclared one would raise)
        role = init_role(name, param, rules)
        if name in _hc_params(model):
            assert role in ("declared", "one", "zero"), name
    for _ in range(2):  # the second init resets what training (here: noise) changed
        init_weights(model, 0.05, seed=0)
        for i, layer in enumerate(model.model.layers):
            for k, hc in ((2 * i, layer.attn_hc), (2 * i + 1, layer.mlp_hc)):
                assert hc is not None and hc.layer == k
                a_m = torch.zeros(rate)
                a_m[k % rate] = 1.0  # sub-layer k reads copy k mod n
                assert torch.equal(hc.static_alpha[:, 0], a_m)
                assert torch.equal(hc.static_alpha[:, 1:], torch.eye(rate))  # A_r = I
                assert torch.equal(hc.static_beta, torch.ones(rate))  # B = 1
                if dynamic:
                    assert not hc.alpha_proj.any() and not hc.beta_proj.any()
                    assert torch.equal(hc.alpha_scale, torch.tensor([0.01]))
                    assert torch.equal(hc.beta_scale, torch.tensor([0.01]))
                    assert torch.equal(hc.norm.weight, torch.ones(model.arch.hidden_size))
                else:
                    assert not hasattr(hc, "alpha_proj") and not hasattr(hc, "norm")
        _randomize(model, seed=2)


@pytest.mark.parametrize("cfg", [MuonConfig(lr=0.02), AdamWConfig(lr=1e-3)], ids=["muon", "adamw"])
def test_hyper_connection_parameters_train_with_adamw_without_decay(cfg: MuonConfig | AdamWConfig) -> None:
    model = build_model(tiny_glm(hyper_connections=2), VOCAB, "sdpa", CPU)
    hc = list(_hc_params(model))
    assert {param_role(name, p.ndim) for name, p in _hc_params(model).items()} == {"hyper"}
    optimizers = build_optimizer(model, cfg).optimizers
    adamw = [opt for opt in optimizers if isinstance(opt, torch.optim.AdamW)]
    assert len(adamw) == 1
    groups = {g["name"]: g for g in adamw[0].param_groups}
    assert groups["hyper"]["param_names"] == hc and groups["hyper"]["weight_decay"] == 0.0
    others = [n for opt in optimizers for g in opt.param_groups if g["name"] != "hyper" for n in g["param_names"]]
    assert not set(hc) & set(others)
    # CompleteP has a rule for the role (like the norm scales)
    assert role_scales(model.arch, "completep", 32, 1)("hyper").lr == 1.0


def test_parameter_counts_include_them_outside_active_matmul() -> None:
    plain = count_params(build_model(tiny_glm(), VOCAB, "sdpa", CPU))
    hyper = count_params(build_model(tiny_glm(hyper_connections=2), VOCAB, "sdpa", CPU))
    # per sub-layer: static_alpha [2, 3], static_beta [2], alpha_proj [3, 64], beta_proj [64], 2 scales, norm [64]
    extra = 3 * 2 * (6 + 2 + 3 * 64 + 64 + 2 + 64)
    assert hyper.total - plain.total == extra and hyper.active_non_embedding - plain.active_non_embedding == extra
    assert hyper.active_matmul == plain.active_matmul and hyper.embedding == plain.embedding


def _perturbed(arch: object) -> CausalLM:
    model = _lmforge(arch)  # type: ignore[arg-type]
    _randomize(model, seed=5, scale=0.1)
    return model.eval()


@pytest.mark.parametrize("dynamic", [False, True], ids=["shc", "dhc"])
def test_cached_generation_equals_the_training_forward(dynamic: bool) -> None:
    model = _perturbed(tiny_glm(hyper_connections=2, hyper_connections_dynamic=dynamic, xsa=True))
    ids = _ids(t=24)[0]
    with torch.no_grad():
        full = model(ids[None], torch.arange(24)[None], torch.tensor([24], dtype=torch.int32))[0]
    cache = KVCache(model, 24)
    steps = [forward_with_cache(model, ids[:10], cache)]
    steps += [forward_with_cache(model, ids[i : i + 1], cache) for i in range(10, 24)]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wrap", ["checkpointed", "compiled"])
def test_checkpointed_or_compiled_blocks_equal_the_eager_model(wrap: str) -> None:
    arch = tiny_glm(hyper_connections=2)
    eager = _perturbed(arch).train()
    other = build_model(arch, VOCAB, "sdpa", CPU)
    other.load_state_dict(eager.state_dict())
    if wrap == "checkpointed":
        apply_activation_checkpointing(other.blocks, 1)
    else:
        for block in other.blocks:  # one graph per block, as `parallelize` compiles with the sdpa backend
            block.compile(fullgraph=True, backend="aot_eager")
    ids, lens = _ids(), torch.tensor([20, 28], dtype=torch.int32)
    outs, grads = [], []
    for model in (eager, other):
        out = model(ids, torch.arange(48)[None], lens)
        out.float().square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in _hc_params(model).items()})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_exports_as_lmforge_moe_and_loads_back_exactly(tmp_path: Path) -> None:
    off = arch_to_hf_config(tiny_glm(hyper_connections_dynamic=False), VOCAB, bos_id=None, eos_id=None, pad_id=None,
                            dtype="float32")  # fmt: skip
    assert off["model_type"] == "glm4_moe" and "hyper_connections" not in off  # n = 0: plain GLM-4.5
    arch = tiny_glm(hyper_connections=4, hyper_connections_dynamic=False, xsa=True)
    model = _perturbed(arch)
    _export(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == RESEARCH_MODEL_TYPE
    assert (config["hyper_connections"], config["hyper_connections_dynamic"]) == (4, False)
    assert read_hf_config(tmp_path).arch == arch.model_copy(update={"head_dim": 16})
    back, _ = load_pretrained(tmp_path)
    assert torch.equal(_logits(back, _ids(), hf=False), _logits(model, _ids(), hf=False))
    assert back.arch.research_options == ["xsa", "hyper_connections"]
