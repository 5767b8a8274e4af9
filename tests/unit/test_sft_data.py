"""SFT samples: loss masks per role from the chat template, packing, the resumable stream, and bad input."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config.data import SFTDataConfig
from lmforge.data.chat import ChatError, ChatTemplate, encode_chat
from lmforge.data.packing import fill_bins
from lmforge.data.sft import SFTData, SFTDataError, load_samples
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.model import build_model
from lmforge.model.init import init_weights
from tests.chat import chat_tokenizer, conversation, write_jsonl
from tests.conftest import require, tiny_llama
from tests.shards import word_tokenizer

TURN = re.compile(r"(<\|im_start\|>(\w+)\n)(.*?<\|im_end\|>\n)", re.S)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TokenizerInfo:
    return load_tokenizer(chat_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer"))


def cfg(paths: list[str], **overrides: object) -> SFTDataConfig:
    fields: dict[str, object] = {"paths": paths, "seq_len": 64, "batch_tokens": 256, "micro_batch_tokens": 64}
    fields.update(overrides)
    return SFTDataConfig(**fields)


def independent_mask(tok: TokenizerInfo, text: str, roles: set[str]) -> tuple[list[int], list[bool]]:
    """Tokens and loss flags from ChatML's own markers, each piece tokenized alone: a turn's header and body count
    when its role is selected, except an assistant turn's header (`<|im_start|>assistant\\n`)."""
    ids: list[int] = []
    loss: list[bool] = []
    pos = 0
    for m in TURN.finditer(text):
        assert m.start() == pos, "the render is a sequence of ChatML turns"
        header, role, body = m.group(1), m.group(2), m.group(3)
        for piece, counts in ((header, role in roles and role != "assistant"), (body, role in roles)):
            piece_ids = tok.tokenizer.encode(piece, add_special_tokens=False).ids
            ids += piece_ids
            loss += [counts] * len(piece_ids)
        pos = m.end()
    assert pos == len(text)
    return ids, loss


ROLE_SETS = [{"assistant"}, {"user"}, {"system", "tool"}, {"system", "user", "assistant", "tool"}]


@pytest.mark.parametrize("roles", ROLE_SETS, ids=lambda r: "+".join(sorted(r)))
def test_loss_mask_matches_the_turn_markers(tok: TokenizerInfo, roles: set[str]) -> None:
    template = ChatTemplate.of(tok)
    counted = 0
    for i in range(6):
        messages = conversation(i, turns=1 + i % 3, system=i % 2 == 0, tool=i % 3 == 1)
        sample = encode_chat(tok, template, messages, roles)
        ids, loss = independent_mask(tok, template.render(messages), roles)
        assert sample.ids.tolist() == ids
        assert sample.loss.tolist() == loss
        counted += sum(loss)
    assert counted > 0, "every setting selects some turns of these conversations"


def test_render_matches_transformers(tok: TokenizerInfo) -> None:
    transformers = require("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok.path.parent))
    template = ChatTemplate.of(tok)
    messages = conversation(3, turns=2, system=True, tool=True)
    for gen in (False, True):
        assert template.render(messages, gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


def test_template_that_rewrites_earlier_turns_is_refused(tok: TokenizerInfo) -> None:
    # Writes the number of turns first: a prefix of the conversation renders differently inside the whole.
    template = ChatTemplate("{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}", tok)
    with pytest.raises(ChatError, match="turn boundaries"):
        encode_chat(tok, template, conversation(0), {"assistant"})


def test_generation_tag_templates_render(tok: TokenizerInfo) -> None:
    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
              "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")  # fmt: skip
    text = ChatTemplate(source, tok).render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert text == "ab"


def test_prompt_completion_layouts(tok: TokenizerInfo, tmp_path: Path) -> None:
    rows = [
        {"prompt": "why do you ask", "completion": " the king"},
        {"prompt": [{"role": "user", "content": "why"}], "completion": "the queen"},
    ]
    samples = load_samples([str(write_jsonl(tmp_path / "pc.jsonl", rows))], tok, cfg(["-"]))
    ids, loss = samples.sample(0)
    head = tok.tokenizer.encode("why do you ask").ids
    tail = tok.tokenizer.encode(" the king", add_special_tokens=False).ids
    assert ids.tolist() == [*head, *tail, tok.eos_id]
    assert loss.tolist() == [False] * len(head) + [True] * (len(tail) + 1)
    ids, loss = samples.sample(1)
    chat = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the queen"}]
    expect_ids, expect_loss = independent_mask(tok, ChatTemplate.of(tok).render(chat), {"assistant"})
    assert ids.tolist() == expect_ids
    assert loss.tolist() == expect_loss


def test_bad_rows_name_file_and_line(tok: TokenizerInfo, tmp_path: Path) -> None:
    good = {"messages": conversation(0)}
    cases = {
        "missing.jsonl": ([good, {"text": "no chat here"}], r"missing\.jsonl line 2: a row needs `messages`"),
        "content.jsonl": ([{"messages": [{"role": "user"}]}], r"content\.jsonl line 1: `messages\[0\]` \(user\)"),
        "empty.jsonl": ([], "no rows"),
        "noloss.jsonl": ([{"messages": [{"role": "user", "content": "why"}]}], "none of the 1 rows has a token"),
    }
    for name, (rows, message) in cases.items():
        with pytest.raises(SFTDataError, match=message):
            load_samples([str(write_jsonl(tmp_path / name, rows))], tok, cfg(["-"]))


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    plain = load_tokenizer(word_tokenizer(tmp_path / "words"))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(0)}])
    with pytest.raises(SFTDataError, match=r"chat\.jsonl line 1: tokenizer .* has no chat template"):
        load_samples([str(path)], plain, cfg(["-"]))


def test_skips_and_overlong_are_counted(tok: TokenizerInfo, tmp_path: Path) -> None:
    long = {"messages": [{"role": "user", "content": "why " * 80}, {"role": "assistant", "content": "ok"}]}
    user_only = {"messages": [{"role": "user", "content": "why"}]}
    rows = [{"messages": conversation(0)}, user_only, long, user_only]
    path = str(write_jsonl(tmp_path / "mixed.jsonl", rows))
    kept = load_samples([path], tok, cfg([path], overlong="truncate"))
    # Truncation cuts the long row before its answer: it has no loss tokens left and is skipped too.
    assert (len(kept), kept.stats.overlong, kept.stats.dropped, kept.stats.no_loss) == (1, 1, 0, 3)
    assert kept.stats.skipped_at[0].endswith("mixed.jsonl line 2")
    assert int(kept.positions.max()) <= 64
    dropped = load_samples([path], tok, cfg([path], overlong="drop"))
    assert (len(dropped), dropped.stats.overlong, dropped.stats.dropped, dropped.stats.no_loss) == (1, 1, 1, 2)
    answer_first = {"messages": [{"role": "assistant", "content": "the king " * 40}]}
    truncated = load_samples([str(write_jsonl(tmp_path / "t.jsonl", [answer_first]))], tok, cfg(["-"]))
    assert len(truncated.sample(0)[0]) == 65


def test_fill_bins_carries_whole_samples() -> None:
    assert fill_bins([3, 4, 2, 5, 1], 8) == [[0, 1], [2, 3, 4]]
    assert fill_bins([3, 4, 2, 5, 1], 8, count=1) == [[0, 1]]
    assert fill_bins([8, 8], 8) == [[0], [1]]
    with pytest.raises(ValueError, match="more than a micro-batch"):
        fill_bins([9], 8)


def chat_file(tmp_path: Path, n: int) -> str:
    rows = [{"messages": conversation(i, turns=1 + i % 2, system=i % 3 == 0)} for i in range(n)]
    return str(write_jsonl(tmp_path / "train.jsonl", rows))


def test_packed_loss_equals_per_sample_loss(tok: TokenizerInfo, tmp_path: Path) -> None:
    """Packing never lets attention or the loss cross a sample boundary: every sample's token losses in a packed
    micro-batch equal those of the sample run alone."""
    path = chat_file(tmp_path, 12)
    data = SFTData(cfg([path], micro_batch_tokens=192, batch_tokens=192), 0, 1, tok)
    model = build_model(tiny_llama(), 512, "sdpa", torch.device("cpu"))
    init_weights(model, 0.02, 0, None, {})
    bins, _ = data._plan(1)
    assert len(bins[0]) >= 3, "the micro-batch packs several samples"
    mb = data.samples.micro_batch(bins[0], 192)
    with torch.no_grad():
        logits = model(mb.input_ids, mb.position_ids, mb.doc_lens)[0]
        packed = torch.nn.functional.cross_entropy(logits, mb.target_ids[0], reduction="none")
        start = 0
        for s in bins[0]:
            ids, loss = data.samples.sample(s)
            n = len(ids) - 1
            x = torch.from_numpy(ids[:-1].astype(np.int64)).unsqueeze(0)
            alone = model(x, torch.arange(n).unsqueeze(0), torch.tensor([n], dtype=torch.int32))[0]
            expect = torch.nn.functional.cross_entropy(
                alone, torch.from_numpy(ids[1:].astype(np.int64)), reduction="none"
            )
            torch.testing.assert_close(packed[start : start + n], expect, rtol=1e-5, atol=1e-5)
            assert mb.loss_mask[0, start : start + n].tolist() == loss[1:].tolist()
            assert mb.position_ids[0, start : start + n].tolist() == list(range(n))
            start += n
    assert not mb.loss_mask[0, start:].any(), "padding is never scored"


def stream(data: SFTData, steps: int) -> list[list[list[int]]]:
    return [[mb.input_ids[0].tolist() for mb in data.next_step()] for _ in range(steps)]


def test_stream_resumes_mid_epoch_and_does_not_depend_on_world_size(tok: TokenizerInfo, tmp_path: Path) -> None:
    path = chat_file(tmp_path, 40)
    c = cfg([path], max_epochs=3, seed=5)
    straight = SFTData(c, 0, 1, tok)
    steps = straight.steps_left()
    assert steps >= 8, "three epochs of 40 samples give several steps"
    full = stream(straight, steps)
    first = SFTData(c, 0, 1, tok)
    head = stream(first, 5)
    state = first.state_dict()
    assert 0 < first.epoch < 3
    resumed = SFTData(c, 0, 1, tok)
    resumed.load_state_dict(state)
    assert head + stream(resumed, steps - 5) == full
    ranks = [SFTData(c, r, 2, tok) for r in range(2)]
    for step in full:
        assert stream(ranks[0], 1)[0] + stream(ranks[1], 1)[0] == step
    with pytest.raises(SFTDataError, match=f"set max_steps to at most {steps}"):
        SFTData(c, 0, 1, tok).check_budget(steps + 1, 0)


def test_every_epoch_visits_every_sample_once_in_a_new_order(tok: TokenizerInfo, tmp_path: Path) -> None:
    data = SFTData(cfg([chat_file(tmp_path, 40)], max_epochs=2, seed=1), 0, 1, tok)
    visits: list[int] = []
    while True:
        bins, _ = data._plan(data.per_step)
        if len(bins) < data.per_step:
            break
        visits += [s for b in bins for s in b]
        data.next_step()
    assert sorted(visits[:40]) == list(range(40))
    second = visits[40:]
    assert second[: len(second)] != visits[: len(second)], "the second epoch has an order of its own"
    assert len(set(second)) == len(second) and max(np.bincount(visits)) == 2


def test_state_from_other_samples_is_refused(tok: TokenizerInfo, tmp_path: Path) -> None:
    data = SFTData(cfg([chat_file(tmp_path, 40)]), 0, 1, tok)
    with pytest.raises(SFTDataError, match="saved over 39 samples"):
        data.load_state_dict({"epoch": 0, "index": 3, "samples": 39})


def test_parquet_and_saved_datasets_give_the_same_samples_as_jsonl(tok: TokenizerInfo, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = require("datasets")
    rows = [{"messages": conversation(i, turns=2, system=i % 2 == 0)} for i in range(10)]
    rows += [{"prompt": "why do you ask", "completion": f" the king {i}"} for i in range(3)]
    c = cfg(["-"])
    jsonl = load_samples([str(write_jsonl(tmp_path / "a.jsonl", rows))], tok, c)
    chat, plain = rows[:10], rows[10:]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    datasets.Dataset.from_list(plain).save_to_disk(str(tmp_path / "saved"))
    mixed = load_samples([str(tmp_path / "chat.parquet"), str(tmp_path / "saved")], tok, c)
    assert mixed.tokens.tolist() == jsonl.tokens.tolist()
    assert mixed.loss.tolist() == jsonl.loss.tolist()
    assert mixed.offsets.tolist() == jsonl.offsets.tolist()
