"""Training on a pool made by `lmforge mix`: per-source token counts and per-source validation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lmforge.config import TokensDataConfig
from lmforge.data.shards import list_shards, open_shard
from lmforge.data.tokenizer import load_tokenizer
from lmforge.data.tokens import TokenData
from lmforge.monitor import read_metrics
from lmforge.prep.mix import SourceSpec, mix_sources
from tests.conftest import arch_toml, tiny_llama
from tests.integration.runner import run_cli
from tests.shards import random_docs, word_tokenizer, write_shard

SEQ, BATCH, STEPS = 32, 256, 6

RUN = (
    """
max_steps = {steps}
output_dir = "{out}"

[tokenizer]
name = "{tok}"

"""
    + arch_toml(
        tiny_llama(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    )
    + """
[data]
type = "tokens"
paths = ["{pool}"]
seq_len = {seq}
batch_tokens = {batch}
micro_batch_tokens = 64

[optim]
lr = 3e-3

[val]
interval = 3
sets = [{{ name = "held", path = "{held}" }}, {{ name = "flat", path = "{flat}" }}]
"""
)


def per_token_sources(pool: Path) -> tuple[np.ndarray, list[str]]:
    """Source index of every token of a one-file mixture pool, by expanding each document's id."""
    names = [s["name"] for s in json.loads((pool / "mix.json").read_text())["sources"]]
    (path,) = list_shards(pool)
    f = open_shard(path)
    lengths = np.diff(np.concatenate([[0], f.doc_ends.astype(np.int64)]))
    ids = np.fromfile(path.with_name(path.name + ".source"), dtype=np.uint8)
    return np.repeat(ids.astype(np.int64), lengths), names


def test_per_source_tokens_and_validation_on_two_ranks(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path / "tok")
    write_shard(tmp_path / "web", "a", random_docs(400, seed=1, mean_len=8))
    write_shard(tmp_path / "code", "a", random_docs(60, seed=2, mean_len=50))
    specs = [SourceSpec("web", str(tmp_path / "web"), 3.0), SourceSpec("code", str(tmp_path / "code"), 1.0)]
    pool, held = tmp_path / "pool", tmp_path / "held"
    mix_sources(specs, 2500, pool, seed=1)
    mix_sources(specs, 600, held, seed=2)
    # The same held-out documents without the manifest: one set, scored as a whole.
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in held.glob("mix.ds*"):
        if not f.name.endswith(".source"):
            shutil.copy(f, flat / f.name)
    cfg = tmp_path / "run.toml"
    out = tmp_path / "run"
    cfg.write_text(RUN.format(steps=STEPS, out=out, tok=tok, pool=pool, seq=SEQ, batch=BATCH, held=held, flat=flat))
    result = run_cli(["train", "@", str(cfg)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0 and "loss/mean" in r]
    assert len(records) == STEPS

    # Counts from training equal the sources of the targets of the windows each step read.
    per_token, names = per_token_sources(pool)
    data = TokenData(TokensDataConfig(seq_len=SEQ, batch_tokens=BATCH, micro_batch_tokens=64, paths=[str(pool)]),
                     0, 1, load_tokenizer(tok))  # fmt: skip
    totals = np.zeros(len(names), dtype=np.int64)
    for step, record in enumerate(records):
        for w in range(step * BATCH // SEQ, (step + 1) * BATCH // SEQ):
            epoch, index = data.position(w)
            offset, order = data._order(epoch)
            start = offset + int(order[index]) * SEQ
            totals += np.bincount(per_token[start + 1 : start + 1 + SEQ], minlength=len(names))
        for name, tokens in zip(names, totals.tolist(), strict=True):
            assert record[f"data/source/{name}/tokens"] == tokens, (step, name)
            assert record[f"data/source/{name}/share"] == pytest.approx(tokens / totals.sum())
    assert totals.sum() == STEPS * BATCH
    assert 0.6 < records[-1]["data/source/web/share"] < 0.9  # 3:1 asked, within a few windows' noise

    # Validation per source; the whole mixture's figure equals the set scored without its manifest.
    vals = [r for r in read_metrics(out / "metrics.jsonl") if "time/val" in r]
    assert [r["step"] for r in vals] == [3, 6]
    for r in vals:
        for metric in ("loss", "bpb", "ppl"):
            assert f"val/held/web/{metric}@{SEQ}" in r and f"val/held/code/{metric}@{SEQ}" in r
        assert r[f"val/held/loss@{SEQ}"] == pytest.approx(r[f"val/flat/loss@{SEQ}"], rel=1e-6)
        assert r[f"val/held/bpb@{SEQ}"] == pytest.approx(r[f"val/flat/bpb@{SEQ}"], rel=1e-6)
        low, high = sorted([r[f"val/held/web/loss@{SEQ}"], r[f"val/held/code/loss@{SEQ}"]])
        assert low <= r[f"val/held/loss@{SEQ}"] <= high
