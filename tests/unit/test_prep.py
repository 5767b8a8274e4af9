"""`lmforge tokenizer train` and `lmforge tokenize`: tokenizer folders, datatrove shards, holdout, input errors."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lmforge.commands.tokenize import main as tokenize_main
from lmforge.commands.tokenizer import train_main as tokenizer_main
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.prep.text_sources import SourceError, iter_documents, list_input_files
from lmforge.prep.tokenize import in_holdout, summarize_shards, task_share
from lmforge.prep.tokenizer_train import SPECIAL_TOKENS, save_tokenizer_folder, train_bpe

pytestmark = pytest.mark.timeout(60)

WORD_TEXT = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will more about can said out up them some "
    "river stone light garden winter morning table window letter market city music"
)


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Short English-like documents with punctuation, newlines and a few non-ASCII characters."""
    rng = random.Random(seed)
    words_list = WORD_TEXT.split()
    docs = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(1, 3)):
            words = [rng.choice(words_list) for _ in range(rng.randint(3, 12))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ", café."]))
        docs.append(rng.choice([" ", "\n"]).join(sentences))
    return docs


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer trained once through the CLI entry on a folder of .txt/.md files plus a .jsonl file."""
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    docs = make_documents(300, seed=1)
    for i, text in enumerate(docs[:20]):
        (corpus / ("sub" if i % 2 else "") / f"doc{i:03d}.{'md' if i % 3 else 'txt'}").write_text(text)
    write_jsonl(root / "rest.jsonl", docs[20:])
    out = root / "tokenizer"
    assert tokenizer_main([str(corpus), str(root / "rest.jsonl"), "--output", str(out), "--vocab-size", "512"]) == 0
    return out


@pytest.fixture(scope="module")
def tok_info(tokenizer_dir: Path) -> TokenizerInfo:
    return load_tokenizer(tokenizer_dir)


def read_shard_documents(folder: Path) -> list[tuple[int, ...]]:
    """Every document in a shard folder, read with numpy from `.ds` / `.ds.index` / `.ds.metadata`."""
    docs: list[tuple[int, ...]] = []
    for ds in sorted(folder.glob("*.ds")):
        header, count = (ds.parent / f"{ds.name}.metadata").read_text().splitlines()[:2]
        token_size = int(header.rsplit("|", 1)[1])
        tokens = np.fromfile(ds, dtype={2: np.uint16, 4: np.uint32}[token_size])
        ends = np.fromfile(ds.parent / f"{ds.name}.index", dtype=np.uint64).astype(np.int64)
        assert int(count) == len(tokens) == ends[-1]
        starts = np.concatenate([[0], ends[:-1]])
        docs.extend(tuple(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True))
    return docs


def expected_documents(info: TokenizerInfo, texts: list[str]) -> Counter[tuple[int, ...]]:
    return Counter(tuple([*info.tokenizer.encode(t).ids, info.eos_id]) for t in texts)


# --- tokenizer training ---------------------------------------------------------------------------------------------


def test_trained_tokenizer_loads_and_round_trips(tokenizer_dir: Path, tok_info: TokenizerInfo) -> None:
    from transformers import AutoTokenizer

    assert sorted(p.name for p in tokenizer_dir.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok_info.bos_id, tok_info.eos_id, tok_info.pad_id)
    assert len({tok_info.bos_id, tok_info.eos_id, tok_info.pad_id}) == 3
    for token in SPECIAL_TOKENS:
        assert hf.convert_tokens_to_ids(token) == tok_info.tokenizer.token_to_id(token)
    assert tok_info.tokenizer.id_to_token(tok_info.eos_id) == "<|endoftext|>"
    assert 300 < tok_info.size <= 512

    sentence = "The river, at morning:  café light!\n\tNew line — 42 🙂"
    ids = tok_info.tokenizer.encode(sentence).ids
    assert tok_info.tokenizer.decode(ids) == sentence
    assert hf.encode(sentence) == ids  # no BOS/EOS added by encode
    assert hf.decode(hf.encode(sentence)) == sentence
    # The special tokens are single tokens, never split by BPE.
    assert tok_info.tokenizer.encode("a<|im_start|>b").ids[1] == tok_info.tokenizer.token_to_id("<|im_start|>")


def test_chat_template_renders_chatml(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]
    text = hf.apply_chat_template(chat, tokenize=False)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
    prompt = hf.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_train_functions_without_cli(tmp_path: Path) -> None:
    tok = train_bpe(make_documents(100), vocab_size=300, min_frequency=1)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.get_vocab_size() == 300
    save_tokenizer_folder(tok, tmp_path / "t")
    assert load_tokenizer(tmp_path / "t").eos_id == 1
    with pytest.raises(ValueError, match="vocab_size 100"):
        train_bpe(["abc"], vocab_size=100)


def test_tokenizer_train_refuses_non_empty_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(50))
    out = tmp_path / "tok"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = [str(corpus), "--output", str(out), "--vocab-size", "300"]
    assert tokenizer_main(args) == 2
    assert "not empty" in capsys.readouterr().err
    assert not (out / "tokenizer.json").exists()
    assert tokenizer_main([*args, "--overwrite"]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "keep.txt").is_file()


# --- tokenize -------------------------------------------------------------------------------------------------------


def run_tokenize(*args: str | Path) -> int:
    return tokenize_main([str(a) for a in args])


def test_tokenize_writes_datatrove_shards_of_every_document(tmp_path: Path, tokenizer_dir: Path) -> None:
    texts = make_documents(200, seed=2)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "shards"
    assert run_tokenize(corpus, "--tokenizer", tokenizer_dir, "--output", out, "--workers", "1") == 0

    info = load_tokenizer(tokenizer_dir)
    docs = read_shard_documents(out)
    assert Counter(docs) == expected_documents(info, texts)
    # Only shard files at the top level, plus datatrove's hidden log folder.
    names = {p.name for p in out.iterdir()}
    stem = "00000_00000_doc_shuffled.ds"
    assert names == {".datatrove", stem, f"{stem}.index", f"{stem}.metadata"}
    header = (out / "00000_00000_doc_shuffled.ds.metadata").read_text().splitlines()[0]
    assert header == f"{info.path.resolve()}|2"
    summary = summarize_shards(out)
    assert (summary.files, summary.documents, summary.tokens) == (1, 200, sum(len(d) for d in docs))


def test_tokenize_shuffle_is_seeded(tmp_path: Path, tokenizer_dir: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(120, seed=3))

    def tokens(folder: str, seed: str) -> bytes:
        assert run_tokenize(corpus, "--tokenizer", tokenizer_dir, "--output", tmp_path / folder, "--seed", seed) == 0
        return b"".join(p.read_bytes() for p in sorted((tmp_path / folder).glob("*.ds")))

    first = tokens("a", "7")
    assert tokens("b", "7") == first
    assert tokens("c", "8") != first


def test_max_tokens_per_file_splits_without_empty_files(tmp_path: Path, tokenizer_dir: Path) -> None:
    texts = make_documents(60, seed=4)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "shards"
    # A limit of 1 token closes a file after every document; datatrove then opens one more that stays empty.
    assert run_tokenize(corpus, "--tokenizer", tokenizer_dir, "--output", out, "--max-tokens-per-file", "1") == 0
    files = sorted(out.glob("*.ds"))
    assert len(files) == 60 and all(f.stat().st_size > 0 for f in files)
    assert files[-1].name == "00000_00059_doc_shuffled.ds"
    assert Counter(read_shard_documents(out)) == expected_documents(load_tokenizer(tokenizer_dir), texts)


def test_holdout_puts_every_document_in_exactly_one_folder(tmp_path: Path, tokenizer_dir: Path) -> None:
    texts = make_documents(400, seed=5)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    train, held = tmp_path / "train", tmp_path / "held"
    split = ["--holdout", "0.2", "--holdout-output", held, "--seed", "3"]
    assert run_tokenize(corpus, "--tokenizer", tokenizer_dir, "--output", train, *split) == 0

    info = load_tokenizer(tokenizer_dir)
    train_docs, held_docs = Counter(read_shard_documents(train)), Counter(read_shard_documents(held))
    assert train_docs + held_docs == expected_documents(info, texts)
    # The split is the documented per-document draw (ids are `file:row`, rows from 1), not an accident.
    drawn = [in_holdout(f"c.jsonl:{row}", 3, 0.2) for row in range(1, len(texts) + 1)]
    assert held_docs == expected_documents(info, [t for t, h in zip(texts, drawn, strict=True) if h])
    assert 0.12 * len(texts) < sum(held_docs.values()) < 0.28 * len(texts)


def test_rerun_refused_without_overwrite(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = make_documents(30, seed=6), make_documents(40, seed=7)
    out = tmp_path / "shards"
    common = ["--tokenizer", tokenizer_dir, "--output", out]
    assert run_tokenize(write_jsonl(tmp_path / "a.jsonl", first), *common) == 0
    capsys.readouterr()
    b = write_jsonl(tmp_path / "b.jsonl", second)
    assert run_tokenize(b, *common) == 2
    assert "not empty" in capsys.readouterr().err
    assert run_tokenize(b, *common, "--overwrite") == 0
    assert Counter(read_shard_documents(out)) == expected_documents(load_tokenizer(tokenizer_dir), second)
    # Files that are not shards are never cleared, even with --overwrite.
    (out / "notes.txt").write_text("mine")
    assert run_tokenize(b, *common, "--overwrite") == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").exists()


def test_overwrite_checks_every_folder_before_clearing(tmp_path: Path, tokenizer_dir: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(40, seed=11))
    train, held = tmp_path / "train", tmp_path / "held"
    split = ["--holdout", "0.3", "--holdout-output", held]
    assert run_tokenize(corpus, "--tokenizer", tokenizer_dir, "--output", train, *split) == 0
    before = sorted(p.name for p in train.glob("*.ds*"))
    (held / "notes.txt").write_text("mine")
    assert run_tokenize(corpus, "--tokenizer", tokenizer_dir, "--output", train, *split, "--overwrite") == 2
    assert before and sorted(p.name for p in train.glob("*.ds*")) == before


@pytest.mark.parametrize("layout", ["one_file", "folder"])
def test_two_tasks_cover_the_source(tmp_path: Path, tokenizer_dir: Path, layout: str) -> None:
    texts = make_documents(90, seed=8)
    if layout == "one_file":  # fewer files than tasks: both tasks share the file by rows
        source = write_jsonl(tmp_path / "c.jsonl", texts)
        workers = "2"  # datatrove's process pool
    else:  # whole files round-robin to tasks
        source = tmp_path / "docs"
        source.mkdir()
        for i, text in enumerate(texts):
            (source / f"{i:03d}.txt").write_text(text)
        workers = "1"
    out = tmp_path / "shards"
    tasks = ["--tasks", "2", "--workers", workers]
    assert run_tokenize(source, "--tokenizer", tokenizer_dir, "--output", out, *tasks) == 0
    assert {p.name.split("_")[0] for p in out.glob("*.ds")} == {"00000", "00001"}
    assert Counter(read_shard_documents(out)) == expected_documents(load_tokenizer(tokenizer_dir), texts)


def test_idle_task_leaves_no_empty_file(tmp_path: Path, tokenizer_dir: Path) -> None:
    texts = make_documents(2, seed=10)
    source = tmp_path / "docs"
    source.mkdir()
    for i, text in enumerate(texts):
        (source / f"{i}.txt").write_text(text)
    out = tmp_path / "shards"
    # Two one-document files over three tasks: tasks 1 and 2 share the files by rows and get nothing to tokenize.
    assert run_tokenize(source, "--tokenizer", tokenizer_dir, "--output", out, "--tasks", "3", "--workers", "1") == 0
    assert sorted(p.name for p in out.glob("*.ds*")) == [
        f"00000_00000_doc_shuffled.ds{suffix}" for suffix in ("", ".index", ".metadata")
    ]
    assert Counter(read_shard_documents(out)) == expected_documents(load_tokenizer(tokenizer_dir), texts)


@pytest.mark.parametrize(("files", "tasks"), [(1, 3), (2, 3), (3, 3), (7, 3), (5, 1)])
def test_task_shares_are_disjoint_and_complete(tmp_path: Path, files: int, tasks: int) -> None:
    from lmforge.prep.text_sources import iter_file_documents

    texts = make_documents(25, seed=9)
    for f in range(files):
        write_jsonl(tmp_path / f"{f}.jsonl", texts)
    inputs = list_input_files([tmp_path])
    seen = Counter(
        doc_id
        for rank in range(tasks)
        for file, shard in task_share(inputs, rank, tasks)
        for doc_id, _ in iter_file_documents(file, "text", shard)
    )
    assert set(seen.values()) == {1} and len(seen) == files * len(texts)


# --- input errors ---------------------------------------------------------------------------------------------------


def test_folder_documents_are_sorted_recursive_and_skip_hidden(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b" / "z.md").write_text("zed")
    (tmp_path / "a.txt").write_text("ay\n\nmore")
    (tmp_path / ".hidden" / "x.txt").write_text("no")
    (tmp_path / "ignored.csv").write_text("no")
    (tmp_path / "empty.txt").write_text("")
    docs = list(iter_documents([tmp_path]))
    assert [text for _, text in docs] == ["ay\n\nmore", "zed"]
    assert [doc_id for doc_id, _ in docs] == [f"{tmp_path.name}/a.txt", f"{tmp_path.name}/b/z.md"]


def test_jsonl_errors_name_file_and_row(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl: row 3: no field 'text'"):
        list(iter_documents([bad]))
    bad.write_text('{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl: row 2: invalid JSON"):
        list(iter_documents([bad]))
    bad.write_text('{"text": "fine"}\n{"text": null}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl: row 2: field 'text' must be a string, got null"):
        list(iter_documents([bad]))

    # Through the command, with the error raised inside a datatrove task: one line, exit 2, no partial shards.
    good = write_jsonl(tmp_path / "good.jsonl", make_documents(20))
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    out = tmp_path / "shards"
    assert run_tokenize(good, bad, "--tokenizer", tokenizer_dir, "--output", out) == 2
    err = capsys.readouterr().err
    assert "lmforge tokenize: error:" in err and "bad.jsonl: row 2: no field 'text'" in err
    assert "Traceback" not in err
    assert not list(out.iterdir())
    assert tokenizer_main([str(bad), "--output", str(tmp_path / "tok")]) == 2
    assert "bad.jsonl: row 2" in capsys.readouterr().err


def test_missing_input_path(tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert run_tokenize(missing, "--tokenizer", tokenizer_dir, "--output", tmp_path / "o") == 2
    assert f"{missing}: does not exist" in capsys.readouterr().err
    assert tokenizer_main([str(missing), "--output", str(tmp_path / "t")]) == 2
    assert f"{missing}: does not exist" in capsys.readouterr().err
    with pytest.raises(SourceError, match="unsupported type"):
        list_input_files([_touch(tmp_path / "data.csv")])
    with pytest.raises(SourceError, match="holds no"):
        list_input_files([_mkdir(tmp_path / "empty")])


@pytest.mark.parametrize("fraction", ["0", "1", "1.5", "-0.1"])
def test_holdout_fraction_out_of_range(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], fraction: str
) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(5))
    args = [corpus, "--tokenizer", tokenizer_dir, "--output", tmp_path / "o"]
    assert run_tokenize(*args, "--holdout", fraction, "--holdout-output", tmp_path / "h") == 2
    assert f"--holdout {float(fraction)}: must be a fraction strictly between 0 and 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_holdout_options_go_together(tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(5))
    args = [corpus, "--tokenizer", tokenizer_dir, "--output", tmp_path / "o"]
    assert run_tokenize(*args, "--holdout", "0.1") == 2
    assert "go together" in capsys.readouterr().err
    assert run_tokenize(*args, "--holdout-output", tmp_path / "h") == 2
    assert run_tokenize(*args, "--holdout", "0.1", "--holdout-output", tmp_path / "o") == 2
    assert "must differ" in capsys.readouterr().err


def test_parquet_rows_are_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first row", "second row", "", "fourth row"]
    pq.write_table(pa.table({"body": texts, "n": [1, 2, 3, 4]}), tmp_path / "data.parquet")
    docs = list(iter_documents([tmp_path / "data.parquet"], text_key="body"))
    assert [text for _, text in docs] == ["first row", "second row", "fourth row"]  # empty texts are skipped
    assert len({doc_id for doc_id, _ in docs}) == 3
    with pytest.raises(SourceError, match=r"data\.parquet"):
        list(iter_documents([tmp_path / "data.parquet"], text_key="text"))


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path
