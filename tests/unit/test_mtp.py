"""Multi-token prediction (DeepSeek-V3's MTP modules): targets that never leave their document, each depth's loss
against one written per document from the definition, the gradient the objective asks for, the host's target
counts equal to the device's, and checkpoints in DeepSeek's layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lmforge.config.hf_config import read_hf_config
from lmforge.data.batch import MicroBatch
from lmforge.hf.weights import SINGLE_FILE, load_hf_weights
from lmforge.model import build_model
from lmforge.model.attention import DocumentMask
from lmforge.model.loss import IGNORE_INDEX, head_cross_entropy
from lmforge.model.mtp import mtp_targets
from lmforge.model.rotary import rotary_cos_sin
from lmforge.train.callbacks.mtp import mtp_target_counts
from tests.unit.test_hf import VOCAB, _export, _from_pretrained, _lmforge, _logits
from tests.unit.test_moe import tiny_deepseek

CPU = torch.device("cpu")
DOCS = torch.tensor([9, 3, 1, 12, 7])
"""A row of 32 tokens: documents shorter and longer than the depths."""


def _row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, 33), generator=gen)
    positions = torch.cat([torch.arange(int(n)) for n in DOCS])[None]
    return ids[:, :-1], ids[:, 1:], positions


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_targets_stay_in_their_document(depth: int) -> None:
    inputs, targets, _ = _row()
    masked = targets.clone()
    masked[0, 5] = IGNORE_INDEX  # a prompt token: no target at depth k for position 5 - k
    doc = torch.repeat_interleave(torch.arange(len(DOCS)), DOCS)
    ids, got = mtp_targets(inputs[0], masked[0], doc, depth)
    for t in range(32):
        inside = t + depth + 1 < 32 and doc[t + depth + 1] == doc[t]
        want = int(masked[0, t + depth]) if inside else IGNORE_INDEX
        assert int(got[t]) == want, t
        if inside:
            assert int(ids[t]) == int(inputs[0, t + depth])
    mb = MicroBatch(inputs, targets, _row()[2], masked != IGNORE_INDEX, DOCS.int())
    counts = mtp_target_counts([mb], 3)
    assert counts[depth - 1] == int((got != IGNORE_INDEX).sum())


def test_each_depth_equals_the_definition_per_document() -> None:
    model = _lmforge(tiny_deepseek(num_nextn_predict_layers=2)).train()
    inputs, targets, positions = _row(1)
    with torch.no_grad():
        model(inputs, positions, DOCS, targets=targets)
    got = model.mtp_loss_sum.clone()
    # Each document alone: depth k predicts token t + k + 1 from the previous depth at t and the token at t + k.
    want = torch.zeros(2, dtype=torch.float64)
    start = 0
    with torch.no_grad():
        for n in DOCS.tolist():
            ids = inputs[0, start : start + n]
            nxt = torch.cat([inputs[0, start + 1 : start + n], targets[0, start + n - 1 : start + n]])
            hidden = model.model(ids[None], torch.arange(n)[None], torch.tensor([n]))[0]
            for k, layer in enumerate(model.model.mtp_layers, start=1):
                m = n - k
                if m <= 0:
                    break
                cos, sin = rotary_cos_sin(torch.arange(m), model.arch, hidden.dtype)
                mask = DocumentMask.from_doc_lens(torch.tensor([m]), CPU)
                hidden = layer(hidden[:m], model.model.embed_tokens(ids[k:n]), cos, sin, mask)
                if m > 1:  # positions 0 .. m - 2 have their target t + k + 1 inside the document
                    logits = model.lm_head(hidden[: m - 1]).double()
                    want[k - 1] += torch.nn.functional.cross_entropy(logits, nxt[k : n - 1], reduction="sum")
            start += n
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (got > 0).all()


def test_the_gradient_is_the_objective_s() -> None:
    model = _lmforge(tiny_deepseek(num_nextn_predict_layers=2)).train()
    twin = _lmforge(tiny_deepseek(num_nextn_predict_layers=2)).train()
    inputs, targets, positions = _row(2)
    scale = torch.tensor([0.3, 0.07])
    model.mtp_scale.copy_(scale)
    loss = model(inputs, positions, DOCS, targets=targets)
    loss.backward()
    # the returned loss is the main model's alone
    x, cos, sin, mask = twin.model.inputs(inputs, positions, DOCS)
    hidden = twin.model.decode(x, cos, sin, mask)
    main = head_cross_entropy(hidden, twin.lm_head.weight, targets[0])
    torch.testing.assert_close(loss, main)
    depths = twin.model.mtp_hidden(hidden, inputs[0], targets[0], cos, sin, mask)
    total = main + sum(
        s * head_cross_entropy(h, twin.lm_head.weight, t) for s, (h, t) in zip(scale, depths, strict=True)
    )
    total.backward()
    theirs = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert theirs[name].grad is None, name
            continue
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    assert model.get_parameter("model.mtp_layers.1.eh_proj.weight").grad.abs().sum() > 0


def test_checkpoints_hold_the_modules_in_deepseek_s_layout(tmp_path: Path) -> None:
    arch = tiny_deepseek(num_nextn_predict_layers=1)
    model = _lmforge(arch)
    _export(model, tmp_path)
    saved = load_file(tmp_path / SINGLE_FILE)
    for local in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
                  "self_attn.kv_b_proj.weight", "mlp.experts.0.gate_proj.weight"):  # fmt: skip
        assert f"model.layers.3.{local}" in saved, local
    assert torch.equal(saved["model.layers.3.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(saved["model.layers.3.shared_head.head.weight"], saved["lm_head.weight"])
    info = read_hf_config(tmp_path)
    assert info.arch.num_nextn_predict_layers == 1
    back = build_model(info.arch, VOCAB, "sdpa", CPU)
    load_hf_weights(back, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    # transformers computes the main model's logits (and leaves the module to its drafting code)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(model.eval(), ids, hf=False), _logits(_from_pretrained(tmp_path), ids, hf=True),
                               atol=1e-5, rtol=0)  # fmt: skip


def test_host_counts_match_the_device_counts_of_a_forward() -> None:
    model = _lmforge(tiny_deepseek(num_nextn_predict_layers=3)).train()
    inputs, targets, positions = _row(4)
    mask = torch.rand(targets.shape, generator=torch.Generator().manual_seed(0)) > 0.2
    with torch.no_grad():
        model(inputs, positions, DOCS, targets=targets.masked_fill(~mask, IGNORE_INDEX))
    mb = MicroBatch(inputs, targets, positions, mask, DOCS.int())
    np.testing.assert_array_equal(mtp_target_counts([mb], 3), model.mtp_tokens.numpy())
