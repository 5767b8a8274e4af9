"""The dense model: HF parameter names and logits, segment isolation, tying, init rules."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.batch import positions_from_doc_lens
from lmforge.model import build_model
from lmforge.model.init import init_role, init_weights
from lmforge.model.llama import CausalLM
from tests.conftest import require, tiny_llama, tiny_qwen3

transformers = require("transformers")

CPU = torch.device("cpu")
VOCAB = 256


def _lmforge(arch: object) -> CausalLM:
    model = build_model(arch, VOCAB, "sdpa", CPU)  # type: ignore[arg-type]
    init_weights(model, 0.05, seed=3)
    return model.eval()


def _hf(model: CausalLM) -> torch.nn.Module:
    arch = model.arch
    fields = arch.model_dump(exclude={"model_type"})
    fields["head_dim"] = arch.dim_per_head
    fields["num_key_value_heads"] = arch.kv_heads
    cls_config = transformers.Qwen3Config if arch.model_type == "qwen3" else transformers.LlamaConfig
    hf_config = cls_config(vocab_size=VOCAB, **fields)
    hf_config._attn_implementation = "eager"
    cls = transformers.Qwen3ForCausalLM if arch.model_type == "qwen3" else transformers.LlamaForCausalLM
    hf = cls(hf_config).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    # HF keeps rotary inverse frequencies as a buffer, which lmforge computes on the fly.
    assert [m for m in missing if "rotary_emb" not in m] == [] and unexpected == []
    return hf


@pytest.mark.parametrize("arch", [tiny_llama(), tiny_qwen3(), tiny_llama(tie_word_embeddings=True, head_dim=32),
                                  tiny_llama(attention_bias=True)], ids=["llama", "qwen3", "tied", "bias"])  # fmt: skip
def test_names_and_logits_match_transformers(arch: object) -> None:
    model = _lmforge(arch)
    hf = _hf(model)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(40)[None], torch.tensor([40], dtype=torch.int32))
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert set(model.state_dict()) == {k for k in hf.state_dict() if "rotary_emb" not in k}


def test_packed_row_equals_documents_run_alone() -> None:
    model = _lmforge(tiny_qwen3())
    lens = torch.tensor([7, 20, 13], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = model(ids, torch.from_numpy(positions_from_doc_lens(lens.numpy()))[None], lens)
        alone = [
            model(chunk, torch.arange(chunk.shape[1])[None], torch.tensor([chunk.shape[1]]))
            for chunk in ids.split(lens.tolist(), dim=1)
        ]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=0)


def test_tied_embeddings_share_storage() -> None:
    model = _lmforge(tiny_llama(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_init_rules_and_seed_dependence() -> None:
    a, b, c = (build_model(tiny_qwen3(), VOCAB, "sdpa", CPU) for _ in range(3))
    init_weights(a, 0.02, seed=0)
    init_weights(b, 0.02, seed=0)
    init_weights(c, 0.02, seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        role = init_role(name, pa)
        if role == "one":
            assert torch.all(pa == 1), name
        elif role == "zero":
            assert torch.all(pa == 0), name
        else:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - 0.02) < 0.005, name


def test_unknown_1d_parameter_fails_with_its_name() -> None:
    model = build_model(tiny_llama(), VOCAB, "sdpa", CPU)
    model.model.layers[0].register_parameter("gate_scale", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.gate_scale"):
        init_weights(model, 0.02, seed=0)


def test_row_length_must_match_seq_lens() -> None:
    model = _lmforge(tiny_llama())
    with pytest.raises(ValueError, match="add up to 30"):
        model(torch.zeros(1, 40, dtype=torch.long), torch.arange(40)[None], torch.tensor([10, 20]))
