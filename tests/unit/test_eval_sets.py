"""Eval set files (ppl, ctxcont, pairs): kinds, errors, tokenization rules, truncation, metrics, packing into
scoring rows, and `lmforge val-sets`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.commands.val_sets import main as val_sets_main
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.eval.scoring import pack_requests
from lmforge.eval.sets import (
    EvalSetError,
    Item,
    Request,
    build_requests,
    fit_requests,
    move_trailing_space,
    name_and_kind,
    ppl_tokens,
    read_eval_dir,
    read_eval_set,
    set_metrics,
)
from lmforge.eval.validation import chunk_rows
from tests.chat import chat_tokenizer, write_jsonl

MC = {"context": "the king speaks ", "continuations": ["and", "why"], "label": 1}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TokenizerInfo:
    return load_tokenizer(chat_tokenizer(tmp_path_factory.mktemp("tok")))


def _ids(tok: TokenizerInfo, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_name_and_kind_from_the_file_name() -> None:
    assert name_and_kind(Path("d/hellaswag.ctxcont.jsonl")) == ("hellaswag", "ctxcont")
    assert name_and_kind(Path("blimp.anaphor.pairs.parquet")) == ("blimp.anaphor", "pairs")
    assert name_and_kind(Path("wiki.v2.jsonl")) == ("wiki.v2", None)
    assert name_and_kind(Path(".ppl.jsonl")) == (".ppl", None)


def test_each_kind_reads_from_jsonl_and_parquet(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.ppl.jsonl", [{"text": "a b"}, {"text": ""}])
    pq.write_table(pa.Table.from_pylist([MC, {**MC, "label": 0}]), tmp_path / "mc.ctxcont.parquet")
    write_jsonl(tmp_path / "bl.pairs.jsonl", [{"good": "the king", "bad": "king the"}])
    ppl, mc, pairs = (read_eval_set(tmp_path / n) for n in ("docs.ppl.jsonl", "mc.ctxcont.parquet", "bl.pairs.jsonl"))
    assert (ppl.name, ppl.kind, ppl.texts) == ("docs", "ppl", ("a b", ""))
    assert (mc.name, mc.kind) == ("mc", "ctxcont")
    assert mc.items[0] == Item("the king speaks ", ("and", "why"), 1, f"{tmp_path / 'mc.ctxcont.parquet'} row 0")
    assert pairs.items == (Item("", ("the king", "king the"), 0, f"{tmp_path / 'bl.pairs.jsonl'} line 1"),)
    assert [s.name for s in read_eval_dir(tmp_path)] == ["bl", "docs", "mc"]


def test_kind_from_a_field_in_every_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "set.v1.jsonl", [{"kind": "pairs", "good": "a", "bad": "b"}] * 2)
    assert (read_eval_set(path).name, read_eval_set(path).kind) == ("set.v1", "pairs")
    write_jsonl(path, [{"kind": "pairs", "good": "a", "bad": "b"}, {"good": "a", "bad": "b"}])
    with pytest.raises(EvalSetError, match=r"set\.v1\.jsonl line 2: kind None differs from the first row's 'pairs'"):
        read_eval_set(path)
    write_jsonl(path, [{"good": "a", "bad": "b"}])
    with pytest.raises(EvalSetError, match=r"set\.v1\.jsonl line 1: unknown set kind None; name the file NAME\.KIND"):
        read_eval_set(path)
    named = write_jsonl(tmp_path / "x.pairs.jsonl", [{"good": "a", "bad": "b"}, {"kind": "ppl", "text": "a"}])
    with pytest.raises(EvalSetError, match=r"x\.pairs\.jsonl line 2: kind 'ppl' contradicts the file name's"):
        read_eval_set(named)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"context": "a", "label": 0}, r"line 2: missing field 'continuations'"),
        ({**MC, "label": 2}, r"line 2: 'label' 2 is not a choice index in \[0, 2\)"),
        ({**MC, "label": True}, r"line 2: 'label' True is not a choice index"),
        ({**MC, "continuations": ["and"], "label": 0}, r"line 2: 'continuations' needs at least 2 choices, got 1"),
        ({**MC, "continuations": ["and", ""]}, r"line 2: continuation 1 is empty"),
        ({**MC, "context": 3}, r"line 2: field 'context' must be a string, got int"),
    ],
)
def test_bad_ctxcont_rows_name_the_file_and_line(tmp_path: Path, row: dict[str, object], message: str) -> None:
    path = write_jsonl(tmp_path / "mc.ctxcont.jsonl", [MC, row])
    with pytest.raises(EvalSetError, match=rf"mc\.ctxcont\.jsonl {message}"):
        read_eval_set(path)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(EvalSetError, match=r"empty\.ppl\.jsonl: the set is empty"):
        read_eval_set(write_jsonl(tmp_path / "empty.ppl.jsonl", []))
    (tmp_path / "bad.ppl.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(EvalSetError, match=r"bad\.ppl\.jsonl line 2: invalid JSON"):
        read_eval_set(tmp_path / "bad.ppl.jsonl")
    with pytest.raises(EvalSetError, match=r"a\.ppl\.txt: an eval set is a \.jsonl or \.parquet file"):
        read_eval_set(tmp_path / "a.ppl.txt")
    pq.write_table(
        pa.Table.from_pylist([{"good": "a", "bad": "b"}, {"good": "a", "bad": None}]), tmp_path / "p.pairs.parquet"
    )
    with pytest.raises(EvalSetError, match=r"p\.pairs\.parquet row 1: missing field 'bad'"):
        read_eval_set(tmp_path / "p.pairs.parquet")
    (tmp_path / "dup").mkdir()
    write_jsonl(tmp_path / "dup" / "a.ppl.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "dup" / "a.pairs.jsonl", [{"good": "x", "bad": "y"}])
    with pytest.raises(EvalSetError, match="both give the set name 'a'"):
        read_eval_dir(tmp_path / "dup")


def test_ppl_documents_come_after_an_eos_and_end_with_one(tok: TokenizerInfo) -> None:
    texts = ["the king speaks", "why do you ask what is the weather today"]
    tokens, starts = ppl_tokens(texts, tok)
    eos = tok.eos_id
    docs = [[eos, *_ids(tok, t), eos] for t in texts]
    assert tokens.tolist() == docs[0] + docs[1] and starts.tolist() == [len(docs[0])]
    rows = chunk_rows(tokens, starts, 64, 64, np.ones(400, dtype=np.int64))
    # every token after each document's leading EOS is scored: the texts and their closing EOS
    assert sum(int(r.batch.loss_mask.sum()) for r in rows) == len(tokens) - 2


def test_trailing_whitespace_moves_into_the_continuation(tok: TokenizerInfo) -> None:
    assert move_trailing_space("Q: A:\n ", "x") == ("Q: A:", "\n x")
    assert move_trailing_space("Q: A:", " x") == ("Q: A:", " x")
    items = [Item("the king speaks ", ("and", "the queen"), 0, "f line 1"), Item("the king", (" speaks",), 0, "")]
    first, second, third = build_requests(items, tok)
    eos = tok.eos_id
    assert first.context.tolist() == [eos, *_ids(tok, "the king speaks")]
    assert first.continuation.tolist() == _ids(tok, " and") and first.nbytes == 3  # bytes as stored
    assert second.tokens.tolist() == [eos, *_ids(tok, "the king speaks the queen")]
    assert (third.item, third.choice, third.continuation.tolist()) == (1, 0, _ids(tok, " speaks"))


def test_a_merge_across_the_boundary_falls_back_to_the_continuation_alone(tok: TokenizerInfo) -> None:
    ctx = _ids(tok, "the kin")
    assert _ids(tok, "the king")[: len(ctx)] != ctx  # precondition: "king" merges across the boundary
    (request,) = build_requests([Item("the kin", ("g",), 0, "")], tok)
    assert request.tokens.tolist() == [tok.eos_id, *ctx, *_ids(tok, "g")]


def test_pairs_score_every_token_after_the_eos(tok: TokenizerInfo) -> None:
    good, bad = build_requests([Item("", ("the king speaks", "king the speaks"), 0, "")], tok)
    assert good.context.tolist() == [tok.eos_id] and good.continuation.tolist() == _ids(tok, "the king speaks")
    assert bad.continuation.tolist() == _ids(tok, "king the speaks")


def _request(ctx: list[int], cont: list[int], item: int = 0, choice: int = 0, nbytes: int = 1,
             nchars: int = 1) -> Request:  # fmt: skip
    return Request(item, choice, np.asarray(ctx, dtype=np.int64), np.asarray(cont, dtype=np.int64), nbytes, nchars)


def test_long_requests_lose_context_from_the_left() -> None:
    items = [Item("c", ("a", "b"), 0, "sets/x.ctxcont.jsonl line 7")]
    short, long = _request([1, 5, 6], [7]), _request([1, 10, 11, 12, 13], [14, 15], choice=1)
    fitted = fit_requests([short, long], 4, items)
    assert fitted[0] is short
    assert fitted[1].tokens.tolist() == [11, 12, 13, 14, 15] and fitted[1].continuation.tolist() == [14, 15]
    assert fit_requests([long], 2, items)[0].tokens.tolist() == [13, 14, 15]
    with pytest.raises(EvalSetError, match=r"x\.ctxcont\.jsonl line 7: continuation 1 has 2 tokens, more than the "):
        fit_requests([long], 1, items)


def test_metrics_and_ties() -> None:
    items = [Item("", ("a", "b", "c"), 2, ""), Item("", ("a", "b"), 0, ""), Item("", ("a", "b"), 1, "")]
    nbytes = [1, 4, 2, 1, 1, 5, 1]
    choices = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)]
    requests = [_request([1], [2], i, j, n) for (i, j), n in zip(choices, nbytes, strict=True)]
    # item 0: raw argmax 1 (wrong), per byte -1, -0.75, -1 -> 1 (wrong); item 1: a tie goes to choice 0 (right);
    # item 2: raw argmax 0 (wrong), per byte -0.4 vs -3 -> 0 (wrong)
    loglik = np.array([-1.0, -3.0, -2.0, -1.5, -1.5, -2.0, -3.0])
    assert set_metrics("ctxcont", items, requests, loglik) == {"acc": pytest.approx(1 / 3), "acc_norm": 1 / 3}
    loglik[[3, 4, 5, 6]] = [-1.0, -2.0, -9.0, -1.0]
    assert set_metrics("ctxcont", items, requests, loglik) == {"acc": 2 / 3, "acc_norm": 2 / 3}
    pair_items = [Item("", ("g", "b"), 0, "")] * 3
    pairs = [_request([1], [2], i, j) for i in range(3) for j in range(2)]
    # good wins, bad wins, a tie: only a strictly more likely good text counts
    assert set_metrics("pairs", pair_items, pairs, np.array([-1.0, -2.0, -3.0, -2.0, -2.0, -2.0])) == {"acc": 1 / 3}


def test_packed_rows_score_each_continuation_token_once_and_no_padding() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, [9, 5], size=(40, 2))
    requests = [_request(rng.integers(2, 50, c).tolist(), rng.integers(2, 50, n).tolist(), k)
                for k, (c, n) in enumerate(sizes)]  # fmt: skip
    rows = pack_requests(requests, 24)
    assert len(rows) > 2 and any(r.request_ids[-1] < 0 for r in rows)
    seen: dict[int, list[int]] = {}
    for row in rows:
        b, ids = row.batch, row.request_ids
        assert b.input_ids.shape == (1, 24) and ids.shape == (24,) and int(b.doc_lens.sum()) == 24
        assert (b.loss_mask[0].numpy() == (ids >= 0)).all()
        for pos in np.flatnonzero(ids >= 0):
            seen.setdefault(int(ids[pos]), []).append(int(b.target_ids[0, pos]))
        if ids[-1] < 0:  # the unscored padding segment closes the row
            assert int(b.doc_lens[-1]) == 24 - sum(len(requests[k].tokens) - 1 for k in set(ids[ids >= 0]))
    assert seen == {k: r.continuation.tolist() for k, r in enumerate(requests)}
    with pytest.raises(ValueError, match=r"request \(item 3, choice 0\) needs 25 positions"):
        pack_requests([_request([1] * 20, [2] * 6, 3)], 24)


def test_val_sets_converts_harness_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"query": "Q: a?", "choices": ["x", "y"], "gold": 1}, {"ctx": "b", "choices": ["u", "v", "w"], "gold": 0}]
    src = write_jsonl(tmp_path / "hs.jsonl", rows)
    assert val_sets_main([str(src), "--kind", "ctxcont", "--output", str(tmp_path / "out"), "--delimiter", " "]) == 0
    out = read_eval_set(tmp_path / "out" / "hs.ctxcont.jsonl")
    assert (out.name, out.kind) == ("hs", "ctxcont")
    expected = [("Q: a?", ("x", "y"), 1, " "), ("b", ("u", "v", "w"), 0, " ")]
    assert [(i.context, i.continuations, i.label, i.target_delimiter) for i in out.items] == expected
    src = write_jsonl(tmp_path / "b.jsonl", [{"sentence_good": "a b", "sentence_bad": "b a", "UID": "x"}])
    assert val_sets_main([str(src), "--kind", "pairs", "--output", str(tmp_path / "out"), "--name", "blimp.x"]) == 0
    assert json.loads((tmp_path / "out" / "blimp.x.pairs.jsonl").read_text()) == {"good": "a b", "bad": "b a"}
    assert read_eval_set(tmp_path / "out" / "blimp.x.pairs.jsonl").name == "blimp.x"
    assert "val-sets: 1 pairs items" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"choices": ["x", "y"], "gold": 0}, "line 2: needs a context field, one of context, query, ctx"),
        ({"context": "a", "choices": ["x"], "gold": 0}, "line 2: 'choices' must be a list of at least 2"),
        ({"context": "a", "choices": ["x", "y"], "gold": 2}, r"line 2: 'gold' 2 is not a choice index in \[0, 2\)"),
    ],
)
def test_val_sets_errors_name_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: dict[str, object], message: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"context": "a", "choices": ["x", "y"], "gold": 0}, row])
    assert val_sets_main([str(src), "--kind", "ctxcont", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmforge val-sets: error: {src} ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)
    assert not (tmp_path / "out").exists()
    assert val_sets_main([str(src), "--kind", "pairs", "--output", str(tmp_path / "o")]) == 2
    assert f"{src} line 1: field 'sentence_good' must be a string, got missing" in capsys.readouterr().err
