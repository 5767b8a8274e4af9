"""Validation on held-out token folders: what is scored, bits per byte, world-size independence, and that it
leaves training untouched."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.validation import chunk_rows, token_bytes
from lmforge.monitor import read_metrics
from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe
from tests.chat import write_jsonl
from tests.integration.runner import losses, run_cli, write_config
from tests.shards import random_docs, word_tokenizer, write_shard


def test_every_token_but_each_chunks_first_is_scored_once() -> None:
    docs = random_docs(30, seed=1)
    tokens = np.concatenate([np.asarray(d) for d in docs]).astype(np.int64)
    doc_starts = np.cumsum([len(d) for d in docs])[:-1]
    nbytes = np.arange(300) % 7
    for seq_len in (4, 16, 64):
        rows = chunk_rows(tokens, doc_starts, seq_len, 64, nbytes)
        chunks = sum(-(-len(d) // seq_len) for d in docs)  # a chunk of c tokens scores c - 1
        scored = sum(int(r.batch.loss_mask.sum()) for r in rows)
        assert scored == len(tokens) - chunks
        assert all(r.batch.input_ids.shape == (1, 64) for r in rows)
        assert max(int(s) for r in rows for s in r.batch.doc_lens) <= max(seq_len - 1, 64)
        assert sum(r.scored_bytes for r in rows) == sum(
            int(nbytes[r.batch.target_ids[r.batch.loss_mask].numpy()].sum()) for r in rows
        )


def test_byte_level_token_bytes_add_up_to_the_text(tmp_path: Path) -> None:
    texts = ["naïve café — 東京 and some plain words", "To be, or not to be: that is the question."]
    save_tokenizer_folder(train_bpe(texts * 20, vocab_size=300), tmp_path / "tok")
    info = load_tokenizer(tmp_path / "tok")
    counts = token_bytes(info)
    for text in texts:
        ids = info.tokenizer.encode(text).ids
        assert int(counts[ids].sum()) == len(text.encode("utf-8"))
    assert counts[info.eos_id] == 0


@pytest.mark.slow
def test_validation_is_world_size_independent_and_leaves_training_alone(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path / "tok")
    write_shard(tmp_path / "heldout", "00000", random_docs(60, seed=5))
    sets = tmp_path / "sets"
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(1, 200, size=n))  # noqa: E731
    write_jsonl(sets / "words.ppl.jsonl", [{"text": words(int(n))} for n in rng.integers(3, 40, size=12)])
    quiz = [
        {"context": words(5), "continuations": [" " + words(2) for _ in range(3)], "label": i % 3} for i in range(9)
    ]
    write_jsonl(sets / "quiz.ctxcont.jsonl", quiz)
    write_jsonl(sets / "minimal.pairs.jsonl", [{"good": words(4), "bad": words(4)} for _ in range(7)])
    for name in ("words.ppl", "quiz.ctxcont"):  # the same sets under lm-evaluation-harness's rules
        shutil.copy(sets / f"{name}.jsonl", sets / f"{name.replace('.', '_h.')}.jsonl")
    cfg = write_config(tmp_path, "base", max_steps=6)
    val = ["--tokenizer.name", str(tok), "--val.interval", "3", "--val.seq-lens", "[16, 64]", "--val.data-dir",
           str(sets), "--val.save-arrays", "--val.sets",
           f'[{{name = "held", path = "{tmp_path / "heldout"}"}}, "words", "quiz", "minimal", '
           '{name = "words_h", convention = "lmeval"}, {name = "quiz_h", convention = "lmeval"}]']  # fmt: skip
    runs = {}
    at_end = [f for f in val if f not in ("--val.interval", "3")]
    for name, flags, nproc in (("plain", [], 1), ("val1", val, 1), ("val2", val, 2), ("end", at_end, 1)):
        out = tmp_path / name
        result = run_cli(["train", "@", str(cfg), "--tokenizer.name", str(tok), "--output-dir", str(out), *flags],
                         nproc=nproc)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = out
    # Validation does not change training: same losses, bit for bit.
    assert losses(runs["val1"]) == losses(runs["plain"])
    records = {n: [r for r in read_metrics(p / "metrics.jsonl") if "time/val" in r] for n, p in runs.items()}
    assert [r["step"] for r in records["val1"]] == [3, 6] and records["plain"] == []
    # eval_on_end alone: one round on the final weights, the same ones val1 scored at step 6.
    assert [r["step"] for r in records["end"]] == [6]
    assert records["end"][0]["val/held/loss@64"] == records["val1"][-1]["val/held/loss@64"]
    keys = ["val/held/loss@16", "val/held/loss@64", "val/held/bpb@16", "val/held/ppl@64", "val/words/loss@16",
            "val/words/bpb@64", "val/quiz/acc@16", "val/quiz/acc_norm@64", "val/minimal/acc@64",
            "val/words_h/word_perplexity@16", "val/words_h/bpb@64", "val/quiz_h/acc_norm@64",
            "val/quiz_h/acc_bytes@16"]  # fmt: skip
    for one, two in zip(records["val1"], records["val2"], strict=True):
        for key in keys:
            assert one[key] == pytest.approx(two[key], rel=1e-5, abs=1e-5), key
    arrays = np.load(runs["val1"] / "val_arrays" / "step_6" / "quiz@64.npz")
    assert arrays["loglik"].shape == (27,) and (arrays["loglik"] < 0).all()
    assert arrays["label"].tolist() == [i % 3 for i in range(9)]
    by_item = arrays["loglik"].reshape(9, 3)
    assert records["val1"][-1]["val/quiz/acc@64"] == pytest.approx(np.mean(by_item.argmax(1) == arrays["label"]))
    assert (runs["val2"] / "val_arrays" / "step_3" / "minimal@16.npz").is_file(), "rank 0 writes them on 2 ranks too"
    last = records["val1"][-1]
    assert last["val/held/loss@64"] < last["val/held/loss@16"] + 0.5  # a longer context does not hurt much
    assert last["val/held/ppl@64"] == pytest.approx(np.exp(last["val/held/loss@64"]))


@pytest.mark.parametrize(
    ("docs", "expected"),
    [
        ([[5, 6, 7], [8, 9, 0]], "the first document ends with token id 7, expected the tokenizer's EOS 0"),
        ([[5, 6, 0], [8, 400, 0]], "token id 400 at offset 4 is outside the vocabulary (300 ids)"),
    ],
    ids=["no-eos", "outside-vocabulary"],
)
def test_a_bad_held_out_folder_is_refused_like_training_data(
    tmp_path: Path, docs: list[list[int]], expected: str
) -> None:
    tok = word_tokenizer(tmp_path / "tok")
    shard = write_shard(tmp_path / "held", "00000", docs)
    cfg = write_config(tmp_path, "run", max_steps=2)
    sets = f'[{{name = "held", path = "{tmp_path / "held"}"}}]'
    result = run_cli(["train", "@", str(cfg), "--tokenizer.name", str(tok), "--val.sets", sets])
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{shard}: {expected}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
