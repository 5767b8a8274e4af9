"""Text -> `lmforge tokenize` (datatrove) -> lmforge's shard reader and `lmforge train`, end to end."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lmforge.commands.tokenize import main as tokenize_main
from lmforge.data.shards import ShardPool
from lmforge.data.tokenizer import load_tokenizer
from lmforge.monitor import read_metrics
from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe
from tests.integration.runner import run_cli

pytestmark = pytest.mark.slow

WORDS = [
    "the",
    "king",
    "queen",
    "sword",
    "crown",
    "night",
    "day",
    "love",
    "death",
    "speak",
    "hear",
    "come",
    "go",
    "fair",
    "foul",
    "my",
    "lord",
    "lady",
    "good",
]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + "." for _ in range(n)]


@pytest.fixture
def prepared(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    texts = corpus(300)
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    save_tokenizer_folder(train_bpe(texts, vocab_size=400), tmp_path / "tok")
    code = tokenize_main([str(source), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "shards"),
                          "--tasks", "2", "--seed", "3"])  # fmt: skip
    assert code == 0
    return tmp_path / "tok", tmp_path / "shards", texts


def test_datatrove_shards_are_read_exactly(prepared: tuple[Path, Path, list[str]]) -> None:
    tok_dir, shards, texts = prepared
    tok = load_tokenizer(tok_dir)
    pool = ShardPool([shards])
    assert len(pool.files) == 2  # one per task
    read = []
    for f in pool.files:
        ends = f.doc_ends.astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        read += [tuple(f.tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    expected = [tuple([*tok.tokenizer.encode(t).ids, tok.eos_id]) for t in texts]
    assert Counter(read) == Counter(expected)
    # the pool's document starts agree with the index across the file boundary
    boundary = int(pool.starts[1])
    _, doc_starts, _ = pool.read(boundary - 5, 10)
    assert boundary in doc_starts.tolist()


def test_tokenize_then_train(prepared: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    tok_dir, shards, _ = prepared
    config = tmp_path / "run.toml"
    config.write_text(f"""
max_steps = 8
output_dir = "{(tmp_path / "run").as_posix()}"
[tokenizer]
name = "{tok_dir.as_posix()}"
[model.arch]
model_type = "qwen3"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
max_position_embeddings = 128
[data]
type = "tokens"
paths = ["{shards.as_posix()}"]
seq_len = 64
batch_tokens = 512
micro_batch_tokens = 128
max_epochs = 3
[optim]
lr = 3e-3
""")
    result = run_cli(["train", "@", str(config)])
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")[1:]  # after the step-0 record
    assert len(records) == 8
    assert records[-1]["loss/mean"] < records[0]["loss/mean"]
    assert 0 < records[-1]["progress/epoch"] < 3
    bad = run_cli(["train", "@", str(config), "--overwrite", "--max-steps", "100000"])
    assert bad.returncode == 2 and "epochs" in bad.stderr and "Traceback" not in bad.stderr


def test_datatrove_shards_without_eos_are_rejected(tmp_path: Path) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer

    from lmforge.config import TokensDataConfig
    from lmforge.data.shards import ShardError
    from lmforge.data.tokens import TokenData
    from lmforge.prep.text_sources import list_input_files
    from lmforge.prep.tokenize import TextReader

    texts = corpus(40, seed=1)
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    save_tokenizer_folder(train_bpe(texts, vocab_size=400), tmp_path / "tok")
    # datatrove appends EOS only when eos_token is set; here it is not
    writer = DocumentTokenizer(str(tmp_path / "noeos"), str(tmp_path / "tok" / "tokenizer.json"), eos_token=None)
    reader = TextReader(list_input_files([source]), "text", None, "train")
    LocalPipelineExecutor([reader, writer], tasks=1, logging_dir=str(tmp_path / "logs")).run()
    cfg = TokensDataConfig(paths=[str(tmp_path / "noeos")], seq_len=16, batch_tokens=64, micro_batch_tokens=32)
    with pytest.raises(ShardError, match="expected the tokenizer's EOS"):
        TokenData(cfg, 0, 1, load_tokenizer(tmp_path / "tok"))
