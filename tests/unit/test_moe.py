"""The MoE block: routing and expert math against a per-token reference, statistics, decoder wiring, roles, init and
parameter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from lmforge.config.arch import DeepseekV3Arch, Glm4MoeArch, GptOssArch, Qwen3MoeArch
from lmforge.config.arch_base import MoESpec
from lmforge.model import build_model
from lmforge.model.attention import DocumentMask
from lmforge.model.completep import completep_scale
from lmforge.model.init import init_weights
from lmforge.model.llama import MLP, CausalLM
from lmforge.model.moe import MoE
from lmforge.model.roles import DECAYED_ROLES, MATRIX_ROLES, param_role
from lmforge.model.rotary import rotary_cos_sin
from tests.conftest import require

CPU = torch.device("cpu")
VOCAB = 256
HIDDEN = 64


def tiny_glm(**overrides: object) -> Glm4MoeArch:
    """A 3-layer GLM-4.5 MoE (one dense layer, then MoE) with every GLM-specific feature switched on."""
    fields: dict[str, object] = {
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "attention_bias": True,
        "use_qk_norm": True,
    }
    fields.update(overrides)
    return Glm4MoeArch(**fields)


def tiny_qwen3_moe(**overrides: object) -> Qwen3MoeArch:
    """A 2-layer Qwen3-MoE."""
    fields: dict[str, object] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    }
    fields.update(overrides)
    return Qwen3MoeArch(**fields)


def tiny_gpt_oss(**overrides: object) -> GptOssArch:
    """A 3-layer gpt-oss (sliding, full, sliding) with a 5-key window, YaRN that does not truncate, and a SwiGLU
    clamp low enough that tiny weights reach it."""
    fields: dict[str, object] = {
        "hidden_size": HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 5,
        "swiglu_limit": 0.4,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": False},
    }
    fields.update(overrides)
    return GptOssArch(**fields)


YARN_MSCALE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
               "mscale_all_dim": 0.8}  # fmt: skip
"""YaRN with DeepSeek's mscale_all_dim, which scales every channel's logits."""


def tiny_deepseek(**overrides: object) -> DeepseekV3Arch:
    """A 3-layer DeepSeek-V3 (one dense layer, then MoE): MLA with value heads narrower than the query/key heads,
    interleaved RoPE, YaRN with mscale_all_dim, group-limited routing and a routed scaling factor."""
    fields: dict[str, object] = {
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "max_position_embeddings": 512,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "rope_scaling": YARN_MSCALE,
    }
    fields.update(overrides)
    return DeepseekV3Arch(**fields)


def _spec(score_func: str, shared: int, norm: bool, scale: float = 1.0, experts: int = 8) -> MoESpec:
    return MoESpec(num_experts=experts, top_k=2, intermediate_size=32, score_func=score_func,  # type: ignore[arg-type]
                   selection_bias=score_func == "sigmoid", norm_topk_prob=norm, routed_scaling_factor=scale,
                   num_shared_experts=shared)  # fmt: skip


def _block(spec: MoESpec, seed: int = 0) -> MoE:
    moe = MoE(spec, HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        if spec.selection_bias:
            moe.gate.e_score_correction_bias.copy_(torch.randn(spec.num_experts, generator=gen) * 0.3)
    return moe


def _x(t: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(seed))


def reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Token by token in float64: the output, the tokens per expert and the summed top-k score share."""
    spec = moe.spec
    e_count, i = spec.num_experts, spec.intermediate_size
    router = moe.gate.weight.double()
    bias = (
        moe.gate.e_score_correction_bias.double() if spec.selection_bias else torch.zeros(e_count, dtype=torch.double)
    )
    gate_up, down = moe.experts.gate_up_proj.double(), moe.experts.down_proj.double()
    out = torch.zeros(x.shape, dtype=torch.double)
    counts = torch.zeros(e_count)
    confidence = 0.0
    for t, xt in enumerate(x.double()):
        logits = router @ xt
        scores = logits.sigmoid() if spec.score_func == "sigmoid" else logits.softmax(0)
        ranked = sorted(range(e_count), key=lambda e: -(scores[e] + bias[e]).item())[: spec.top_k]
        gates = scores[ranked]
        confidence += (gates.sum() / scores.sum()).item()
        if spec.norm_topk_prob:
            gates = gates / gates.sum()
        gates = gates * spec.routed_scaling_factor
        for gate, e in zip(gates, ranked, strict=True):
            hidden = F.silu(gate_up[e, :i] @ xt) * (gate_up[e, i:] @ xt)
            out[t] += gate * (down[e] @ hidden)
            counts[e] += 1
        if moe.shared_experts is not None:
            mlp = moe.shared_experts
            w_gate, w_up, w_down = (m.weight.double() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            out[t] += w_down @ (F.silu(w_gate @ xt) * (w_up @ xt))
    return out, counts, confidence


SPECS = [
    _spec("sigmoid", shared=1, norm=True, scale=2.5),
    _spec("sigmoid", shared=0, norm=False),
    _spec("softmax", shared=0, norm=True),
    _spec("softmax", shared=2, norm=False),
]
SPEC_IDS = ["glm", "sigmoid-unnormed-no-shared", "qwen3-normed", "softmax-shared"]


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_block_equals_per_token_reference(spec: MoESpec, impl: str) -> None:
    moe = _block(spec).train()
    moe.experts.impl = impl  # type: ignore[assignment]
    x = _x()
    expected, counts, confidence = reference(moe, x)
    torch.testing.assert_close(moe(x), expected.float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(moe.tokens_per_expert, counts)
    assert moe.tokens_per_expert.sum() == x.shape[0] * spec.top_k
    assert moe.routing_confidence_sum.item() == pytest.approx(confidence, rel=1e-5)


def test_selection_bias_changes_the_choice_but_not_the_gate_values() -> None:
    moe = _block(_spec("sigmoid", shared=0, norm=True, scale=2.5))
    x = _x()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        plain = moe.gate(x)
        moe.gate.e_score_correction_bias[5] = 10.0  # expert 5 wins every token's first slot
        biased = moe.gate(x)
    assert (biased.indices == 5).any(-1).all()
    assert not (plain.indices == 5).any(-1).all()
    # Gate values are the unbiased sigmoid scores of the chosen experts, normalized, then scaled.
    scores = (x @ moe.gate.weight.T).sigmoid()
    chosen = scores.gather(-1, biased.indices)
    torch.testing.assert_close(biased.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert not torch.allclose(biased.weights, plain.weights)
    # And the block's output follows: reference() applies the bias in the choice only.
    expected, _, _ = reference(moe, x)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), expected.float(), atol=1e-5, rtol=1e-5)


def test_statistics_count_training_forwards_once() -> None:
    moe = _block(_spec("sigmoid", shared=1, norm=True))
    x = _x()
    _, counts, confidence = reference(moe, x)
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.sum() == 0, "eval forwards (validation, generation) must not count"
    moe.train()
    moe(x)
    moe(x).sum().backward()
    assert torch.equal(moe.tokens_per_expert, 2 * counts)
    assert moe.routing_confidence_sum.item() == pytest.approx(2 * confidence, rel=1e-5)
    # Activation checkpointing recomputes the forward in backward; the recomputation must not count again.
    moe.reset_stats()
    assert moe.tokens_per_expert.sum() == 0 and moe.routing_confidence_sum == 0
    # Without early stop the recomputation runs the whole forward, the statistics update included.
    with set_checkpoint_early_stop(False):
        checkpoint(moe, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert torch.equal(moe.tokens_per_expert, counts)
    # Non-persistent: statistics are not model state.
    assert set(moe.state_dict()) == {n for n, _ in moe.named_parameters()} | {"gate.e_score_correction_bias"}


def test_grouped_mm_and_loop_give_equal_gradients() -> None:
    grads = {}
    for impl in ("grouped_mm", "loop"):
        moe = _block(_spec("softmax", shared=1, norm=True))
        moe.experts.impl = impl  # type: ignore[assignment]
        x = _x().requires_grad_()
        (moe(x) * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        grads[impl] = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    for name, grad in grads["loop"].items():
        torch.testing.assert_close(grads["grouped_mm"][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_selection_bias_update_follows_the_sign_rule() -> None:
    moe = _block(_spec("sigmoid", shared=0, norm=True, experts=4))
    before = moe.gate.e_score_correction_bias.clone()
    delta = moe.gate.update_selection_bias(torch.tensor([10.0, 2.0, 4.0, 4.0]), coeff=0.01)
    # mean 5: expert 0 is over-loaded (bias down), the others under-loaded (bias up).
    torch.testing.assert_close(delta, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    torch.testing.assert_close(moe.gate.e_score_correction_bias, before + delta)
    with pytest.raises(ValueError, match="no selection bias"):
        _block(_spec("softmax", shared=0, norm=True)).gate.update_selection_bias(torch.ones(8), 0.01)


def _model(arch: Glm4MoeArch | Qwen3MoeArch, seed: int = 3) -> CausalLM:
    model = build_model(arch, VOCAB, "sdpa", CPU)
    init_weights(model, 0.05, seed=seed)
    return model


def test_decoder_layout_and_names_match_transformers() -> None:
    transformers = require("transformers")
    glm = _model(tiny_glm())
    assert isinstance(glm.model.layers[0].mlp, MLP)
    assert sorted(glm.moe_layers()) == [1, 2]
    assert glm.model.layers[0].self_attn.o_proj.bias is None and glm.model.layers[0].self_attn.q_proj.bias is not None
    qwen = _model(tiny_qwen3_moe())
    assert sorted(qwen.moe_layers()) == [0, 1] and qwen.model.layers[0].mlp.shared_experts is None
    configs = {
        "glm4_moe": transformers.Glm4MoeConfig(vocab_size=VOCAB, **_hf_fields(glm)),
        "qwen3_moe": transformers.Qwen3MoeConfig(vocab_size=VOCAB, **_hf_fields(qwen)),
    }
    for model in (glm, qwen):
        hf = transformers.AutoModelForCausalLM.from_config(configs[model.arch.model_type])
        theirs = {k: v.shape for k, v in hf.state_dict().items() if "rotary_emb" not in k}
        assert {k: v.shape for k, v in model.state_dict().items()} == theirs


def _hf_fields(model: CausalLM) -> dict[str, object]:
    arch = model.arch
    fields = arch.model_dump(exclude={"model_type", "load_balance_coeff", "partial_rotary_factor", "mlp_only_layers"})
    fields.update(head_dim=arch.dim_per_head, num_key_value_heads=arch.kv_heads)
    return fields


def test_param_counts_by_hand() -> None:
    arch = tiny_glm(attention_bias=False, use_qk_norm=False)
    counts = _model(arch).param_counts()
    h, kv, heads, dense, moe_i, experts, k = 64, 2 * 16, 4 * 16, 128, 32, 8, 2
    attention = h * heads + 2 * h * kv + heads * h
    norms = 2 * h
    router, routed, shared = experts * h, experts * 3 * h * moe_i, 3 * h * moe_i
    embed = head = VOCAB * h
    blocks = 3 * (attention + norms) + 3 * h * dense + 2 * (router + routed + shared)
    total = embed + head + h + blocks
    assert counts.total == total
    assert counts.embedding == embed and counts.non_embedding == total - embed
    assert counts.active_non_embedding == total - embed - 2 * routed * (1 - k / experts)
    assert counts.active_matmul == counts.active_non_embedding - h - 3 * norms  # matrices only
    assert counts.metrics()["params/active_non_embedding"] == counts.active_non_embedding
    # A tied head counts once in the totals but multiplies every token.
    tied = _model(tiny_glm(attention_bias=False, use_qk_norm=False, tie_word_embeddings=True)).param_counts()
    assert tied.total == total - head and tied.active_matmul == counts.active_matmul


def test_roles_init_and_buffers() -> None:
    model = build_model(tiny_glm(), VOCAB, "sdpa", CPU)
    for moe in model.moe_layers().values():
        assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(8)), "build_model zeroes buffers"
        moe.gate.e_score_correction_bias.fill_(3.0)
        moe.tokens_per_expert.fill_(7.0)
    init_weights(model, 0.02, seed=0)
    roles = {name: param_role(name, p.ndim) for name, p in model.named_parameters()}
    assert roles["model.layers.1.mlp.gate.weight"] == "router"
    assert roles["model.layers.1.mlp.experts.gate_up_proj"] == "expert_hidden"
    assert roles["model.layers.1.mlp.experts.down_proj"] == "expert_out"
    assert roles["model.layers.1.mlp.shared_experts.down_proj.weight"] == "residual_out"
    assert roles["model.layers.0.mlp.gate_proj.weight"] == "hidden"
    assert {"router", "expert_hidden", "expert_out"} <= DECAYED_ROLES and not {"router", "expert_hidden"} & MATRIX_ROLES
    params = dict(model.named_parameters())
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.2.mlp.experts.gate_up_proj",
                 "model.layers.2.mlp.experts.down_proj"):  # fmt: skip
        assert abs(params[name].std().item() - 0.02) < 0.002, name
    for moe in model.moe_layers().values():
        assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(8)), "init zeroes the selection bias"
        assert moe.tokens_per_expert.sum() == 0
    # CompleteP treats routed experts like the dense matrices they replace, the router like a hidden matrix.
    assert completep_scale("expert_out", 4.0, 2.0) == completep_scale("residual_out", 4.0, 2.0)
    assert completep_scale("expert_hidden", 4.0, 2.0) == completep_scale("router", 4.0, 2.0)
    assert completep_scale("router", 4.0, 2.0) == completep_scale("hidden", 4.0, 2.0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: tiny_glm(n_group=3), r"n_routed_experts 8 must split into n_group 3 equal groups"),
        (lambda: tiny_glm(n_group=4, topk_group=5), r"topk_group 5 exceeds n_group 4"),
        (lambda: tiny_glm(n_group=4, num_experts_per_tok=3), r"num_experts_per_tok 3 exceeds the experts of"),
        (lambda: tiny_glm(n_group=2, null_experts=2), r"n_group > 1\) takes neither null_experts"),
        (lambda: tiny_glm(num_experts_per_tok=9), r"num_experts_per_tok 9 exceeds n_routed_experts 8"),
        (lambda: tiny_glm(first_k_dense_replace=4), r"first_k_dense_replace 4 exceeds num_hidden_layers 3"),
        (lambda: tiny_glm(partial_rotary_factor=0.2), r"rotary part of a head \(3 of head_dim 16\)"),
        (lambda: tiny_qwen3_moe(mlp_only_layers=[1]), r"mlp_only_layers \[1\] is not supported"),
        (lambda: tiny_qwen3_moe(decoder_sparse_step=2), r"decoder_sparse_step 2 .* is not supported"),
        (lambda: tiny_qwen3_moe(num_experts=1), r"num_experts"),
    ],
    ids=[
        "uneven-groups",
        "topk-group",
        "group-capacity",
        "groups-null",
        "top-k",
        "dense-layers",
        "odd-rotary",
        "mlp-only",
        "sparse-step",
        "one-expert",
    ],
)
def test_unsupported_architectures_are_refused(make: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        make()  # type: ignore[operator]


def test_partial_rotary_turns_only_the_leading_channels() -> None:
    model = _model(tiny_glm(partial_rotary_factor=0.5))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    attn = model.model.layers[0].self_attn
    x = model.model.embed_tokens(ids[0])
    cos, sin = rotary_cos_sin(torch.arange(12), model.arch, x.dtype)
    q, _, _ = attn.qkv(x, cos, sin)
    plain = attn.q_norm(attn.q_proj(x).view(12, 4, 16))
    assert torch.equal(q[..., 8:], plain[..., 8:]) and not torch.allclose(q[1:, :, :8], plain[1:, :, :8])


def test_compiled_block_equals_eager() -> None:
    model = _model(tiny_qwen3_moe(num_hidden_layers=1)).train()
    block = model.blocks[0]
    x = _x(24).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(24), model.arch, torch.float32)
    mask = DocumentMask.from_doc_lens(torch.tensor([10, 14]), CPU)
    eager = block(x, cos, sin, mask)
    eager.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    counts = model.moe_layers()[0].tokens_per_expert.clone()
    model.zero_grad()
    model.reset_moe_stats()
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, cos, sin, mask)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for name, param in block.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-4, rtol=1e-4, msg=name)
    assert torch.equal(model.moe_layers()[0].tokens_per_expert, counts)


@pytest.mark.gpu
def test_grouped_mm_on_cuda_is_sync_free_and_equals_the_loop() -> None:
    moe = _block(_spec("sigmoid", shared=1, norm=True, scale=2.5)).cuda().bfloat16().train()
    x = _x(512).cuda().bfloat16()
    moe.experts.impl = "loop"
    expected = moe(x)
    moe.experts.impl = "grouped_mm"
    moe.reset_stats()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe(x)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    assert moe.tokens_per_expert.sum().item() == 512 * 2


def test_loop_reference_is_selectable_and_grouped_refuses_misaligned_shapes() -> None:
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=6, score_func="softmax", selection_bias=False,
                   norm_topk_prob=False, routed_scaling_factor=1.0, num_shared_experts=0)  # fmt: skip
    moe = _block(spec)
    x = _x(10)
    expected, _, _ = reference(moe, x)
    torch.testing.assert_close(moe(x), expected.float(), atol=1e-5, rtol=1e-5)  # auto falls back to the loop
    moe.experts.impl = "grouped_mm"
    with pytest.raises(ValueError, match="divisible by 4"):
        moe(x)


def test_group_limited_routing_equals_a_per_token_reference() -> None:
    # 8 experts in 4 groups of 2, each token picking its 2 experts from its 2 best groups; a selection bias large
    # enough to move groups.
    model = _model(tiny_glm(n_group=4, topk_group=2))
    gate = model.moe_layers()[1].gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)) * 0.3)
    x = _x(40)
    routing = gate(x)
    scores = torch.sigmoid(x.float() @ gate.weight.float().T)
    choice = scores + gate.e_score_correction_bias
    moved = 0
    for t in range(40):
        group_score = [sorted(choice[t, 2 * g : 2 * g + 2].tolist())[-2:] for g in range(4)]
        best = sorted(range(4), key=lambda g: sum(group_score[g]), reverse=True)[:2]
        allowed = [e for g in best for e in (2 * g, 2 * g + 1)]
        want = sorted(allowed, key=lambda e: float(choice[t, e]), reverse=True)[:2]
        assert sorted(routing.indices[t].tolist()) == sorted(want)
        moved += sorted(want) != sorted(choice[t].topk(2).indices.tolist())
        gates = scores[t, want] / scores[t, want].sum() * 2.5  # norm_topk_prob, routed_scaling_factor
        torch.testing.assert_close(
            routing.weights[t, torch.argsort(routing.indices[t])], gates[torch.argsort(torch.tensor(want))]
        )
    assert moved > 0, "the groups changed no token's experts: the check would prove little"
