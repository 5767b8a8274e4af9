"""`lmforge replay`: the micro-batches of a run trained on two ranks, rebuilt in one process, equal what each rank
received (captured by hooking the trainer, `capture_run.py`); the documents listed add up to the logged token
counts; `--verify` accepts the logged batch hashes and names the step of a tampered shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from lmforge.checkpoint.layout import data_position_before
from lmforge.data.replay import ReplayedBatch, replay_next_step, seek
from lmforge.data.shards import list_shards
from lmforge.data.stream import build_step_data
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.step_documents import RunSteps
from lmforge.eval.worker import read_run_config
from lmforge.monitor import read_metrics
from lmforge.prep.mix import SourceSpec, mix_sources
from tests.chat import chat_tokenizer, conversation, write_jsonl
from tests.conftest import arch_toml, tiny_llama
from tests.integration.runner import env_one_thread, run_cli
from tests.integration.test_viz import CHROMIUM, require_browser
from tests.shards import EOS, random_docs, write_shard

pytestmark = pytest.mark.slow

CAPTURE = Path(__file__).with_name("capture_run.py")

ARCH = arch_toml(tiny_llama(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=128))  # fmt: skip

TOKENS = """
max_steps = {steps}
output_dir = "{out}"

[tokenizer]
name = "{tok}"

[data]
type = "tokens"
paths = ["{pool}"]
seq_len = 32
batch_tokens = 256
micro_batch_tokens = 64
max_epochs = 3

[log]
batch_hashes = true

[ckpt]
interval = 2
keep_last = 8

[optim]
lr = 3e-3
"""

SFT = """
max_steps = 3
output_dir = "{out}"

[tokenizer]
name = "{tok}"

[data]
type = "sft"
paths = ["{chat}"]
seq_len = 128
batch_tokens = 512
micro_batch_tokens = 128
max_epochs = 4

[log]
batch_hashes = true

[ckpt]
interval = 1
keep_last = 3

[optim]
lr = 3e-3
"""


def train_capturing(cfg: Path, capture: Path, *flags: str) -> None:
    """Train on two ranks, saving what each rank's trainer received into `capture`."""
    capture.mkdir(exist_ok=True)
    env = {**env_one_thread(), "CAPTURE_DIR": str(capture)}
    result = run_cli(["train", "@", str(cfg), *flags], nproc=2, script=CAPTURE, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def captured(capture: Path, step: int, ranks: int = 2) -> dict[str, np.ndarray]:
    """The step's micro-batch rows of every rank, rank 0's first (the global order)."""
    parts = [np.load(capture / f"rank{r}_step{step}.npz") for r in range(ranks)]
    return {name: np.concatenate([p[name] for p in parts]) for name in ("input_ids", "target_ids", "loss_mask")}


def replayed(run: Path, step: int) -> list[ReplayedBatch]:
    """Step `step` of `run`, rebuilt in this process from the run directory."""
    config = read_run_config(run)
    stream = build_step_data(config.data, 0, 1, load_tokenizer(str(config.tokenizer.name)))
    anchor, position = data_position_before(run, step)
    seek(stream, position, step - 1 - anchor)
    return replay_next_step(stream)


def assert_same_batches(batches: list[ReplayedBatch], trained: dict[str, np.ndarray], step: int) -> None:
    for name in ("input_ids", "target_ids", "loss_mask"):
        ours = np.concatenate([getattr(b.batch, name).numpy() for b in batches])
        assert np.array_equal(ours, trained[name]), (step, name)


def replay_json(run: Path, step: int, tmp: Path, *flags: str) -> dict[str, Any]:
    out = tmp / f"step{step}.json"
    result = run_cli(["replay", str(run), "--step", str(step), "--json", str(out), *flags])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def assert_scores_add_up(listing: dict[str, Any], record: dict[str, float], checkpoint: int) -> None:
    """Scored with the checkpoint of the step before, the documents' losses add up to the step's logged loss, and
    the top list holds the documents of highest summed loss."""
    score = listing["score"]
    assert score["checkpoint"] == checkpoint
    docs = [d for mb in listing["micro_batches"] for row in mb["rows"] for d in row["documents"]]
    assert sum(d["loss_tokens"] for d in docs) == score["loss_tokens"] == record["loss/tokens"]
    assert sum(d["loss_sum"] for d in docs) == pytest.approx(score["loss_sum"], rel=1e-12)
    assert score["loss_sum"] == pytest.approx(record["loss/mean"] * record["loss/tokens"], rel=1e-5)
    assert score["logged_loss_mean"] == record["loss/mean"]
    highest = sorted((d["loss_sum"] for d in docs), reverse=True)[: len(score["top"])]
    assert [d["loss_sum"] for d in score["top"]] == highest and highest[0] > 0


def markup_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer (EOS at 0) whose first ids decode to script tags: document text that must stay text."""
    vocab = {EOS: 0, **{(f"<script>window.__pwned={i}</script>" if i <= 40 else f"w{i}"): i for i in range(1, 300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def assert_report_lists_the_spike(run: Path, tmp: Path, scored: dict[str, Any]) -> None:
    """`lmforge report --spikes` shows step 5's top documents as `replay --score` ranks them, their text (holding
    script tags) as text in Chromium."""
    require_browser()
    from playwright.sync_api import sync_playwright

    report = tmp / "report.html"
    result = run_cli(["report", str(run), "-o", str(report), "--spikes"])
    assert result.returncode == 0, result.stderr[-3000:]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(report.as_uri(), wait_until="load")
            page.wait_for_timeout(300)
            pwned = page.evaluate("() => typeof window.__pwned")
            table = page.inner_text("#spikes table")
            cells = page.eval_on_selector_all("#spike-5 tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
            note = page.inner_text("#spike-5 .note")
        finally:
            browser.close()
    assert pwned == "undefined"
    assert "5\tloss" in table
    assert "checkpoint step_4 (the step before)" in note
    shown = [(row[3], row[4]) for row in cells[1:]]
    top = scored["score"]["top"]
    assert [w for w, _ in shown] == [d["where"] + (f" [{d['source']}]" if d["source"] else "") for d in top]
    assert [t.replace("\n", "") for _, t in shown] == [d["text"].replace("\n", "") for d in top]
    assert any("<script>" in t for _, t in shown), shown


def test_token_mixture_steps_replay_in_one_process_across_an_epoch_and_a_resume(tmp_path: Path) -> None:
    tok = markup_tokenizer(tmp_path / "tok")
    write_shard(tmp_path / "web", "a", random_docs(120, seed=1, mean_len=8))
    write_shard(tmp_path / "code", "a", random_docs(20, seed=2, mean_len=40))
    pool = tmp_path / "pool"
    mix_sources([SourceSpec("web", str(tmp_path / "web"), 3.0), SourceSpec("code", str(tmp_path / "code"), 1.0)],
                900, pool, seed=1)  # fmt: skip
    run, capture = tmp_path / "run", tmp_path / "capture"
    cfg = tmp_path / "run.toml"
    cfg.write_text(TOKENS.format(steps=4, out=run, tok=tok, pool=pool) + ARCH)
    train_capturing(cfg, capture)
    # The same run goes on from its step-4 checkpoint for three more steps.
    train_capturing(cfg, capture, "--max-steps", "7", "--resume.step", "latest")

    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0}
    assert sorted(records) == list(range(1, 8))
    epochs = [records[s]["progress/epoch"] for s in range(1, 8)]
    assert epochs[0] < 1 < epochs[-1], f"the steps should cross an epoch: {epochs}"
    sources_before = {"web": 0.0, "code": 0.0}
    trained_in: dict[str, list[tuple[int, int, int]]] = {}
    source_of: dict[str, str] = {}
    for step in range(1, 8):
        batches = replayed(run, step)
        for b in batches:
            for row in b.rows:
                for p in row.pieces:
                    if p.loss_tokens:
                        window = int(row.label.split()[1])
                        trained_in.setdefault(p.where, []).append((step, b.index, window))
                        source_of[p.where] = str(p.source)
        assert_same_batches(batches, captured(capture, step), step)
        loss_tokens, by_source = 0, {"web": 0, "code": 0}
        for b in batches:
            for row, ids in zip(b.rows, b.batch.input_ids.numpy().reshape(-1, 32), strict=True):
                # The documents' parts, end to end, are the window's tokens.
                window = np.concatenate([p.token_ids for p in row.pieces])
                assert np.array_equal(window[:-1], ids), (step, row.label)
                assert row.pieces[0].start == 0 and len(window) == 33
                for p in row.pieces:
                    loss_tokens += p.loss_tokens
                    by_source[str(p.source)] += p.loss_tokens
        assert loss_tokens == records[step]["loss/tokens"]
        for name, count in by_source.items():
            logged = records[step][f"data/source/{name}/tokens"]
            assert count == logged - sources_before[name], (step, name)
            sources_before[name] = logged

    # Every document's steps, asked of --document's code, are where the replays above found it.
    steps = RunSteps(run)
    for where, found in trained_in.items():
        file, index = where.split(" doc ")
        asked = steps.document_steps(f"{file}:{index}")
        assert [(d["step"], d["micro_batch"], d["window"]) for d in asked] == sorted(found), where
    repeated = next(w for w, found in trained_in.items() if len({f[0] for f in found}) > 1 and found[-1][0] >= 5)
    named = f"{source_of[repeated]}:{repeated.replace(' doc ', ':')}"  # SOURCE:FILE:INDEX
    cli = run_cli(["replay", str(run), "--document", named])
    assert cli.returncode == 0 and f"step {trained_in[repeated][-1][0]}, micro-batch" in cli.stdout, cli.stdout
    other = {"web": "code", "code": "web"}[source_of[repeated]]
    wrong = run_cli(["replay", str(run), "--document", f"{other}:{repeated.replace(' doc ', ':')}"])
    assert wrong.returncode == 2 and f"comes from source '{source_of[repeated]}'" in wrong.stderr, wrong.stderr
    unseen = run_cli(["replay", str(run), "--document", f"{repeated.split(' doc ')[0]}:9999"])
    assert unseen.returncode == 2 and "holds documents 0.." in unseen.stderr

    # The command line: step 5 begins from the step-4 checkpoint's position; its documents name file and source.
    listing = replay_json(run, 5, tmp_path, "--score", "--top", "3")
    assert listing["from_checkpoint"] == 4 and listing["micro_batches_in_step"] == 4
    assert_scores_add_up(listing, records[5], checkpoint=4)
    assert listing["batch_hash"] == records[5]["batch/hash"]
    docs = [d for mb in listing["micro_batches"] for row in mb["rows"] for d in row["documents"]]
    assert {d["source"] for d in docs} == {"web", "code"}
    assert all(d["where"].startswith(str(pool)) and " doc " in d["where"] for d in docs)
    assert any(d["cut_before"] for d in docs) and any(d["cut_after"] for d in docs)
    assert all(d["text"] for d in docs) and any("<script>" in d["text"] for d in docs)  # the run's tokenizer
    one = replay_json(run, 5, tmp_path, "--micro-batch", "2")
    assert [mb["index"] for mb in one["micro_batches"]] == [2]

    verified = run_cli(["replay", str(run), "--verify"])
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert "7 steps verified" in verified.stdout

    # A spike planted at step 5: the report replays it and lists the documents `replay --score` ranks first.
    planted = [{**r, "loss/spike": 1.0} if r["step"] == 5 else r for r in read_metrics(run / "metrics.jsonl")]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in planted))
    assert_report_lists_the_spike(run, tmp_path, replay_json(run, 5, tmp_path, "--score", "--top", "5", "--chars", "0"))

    # One token changed in the pool: the first step that trained on it no longer hashes to what was logged.
    (shard,) = list_shards(pool)
    first = replayed(run, 3)[0].rows[0]
    offset = int(first.label.split("pool offset ")[1].rstrip(")")) + 10
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[offset] = 1 + tokens[offset] % 250
    tokens.tofile(shard)
    tampered = run_cli(["replay", str(run), "--verify"])
    assert tampered.returncode == 1, tampered.stdout + tampered.stderr
    steps = [s for s in range(1, 8) if any(r.label == first.label for b in replayed(run, s) for r in b.rows)]
    assert f"step {steps[0]}: the replayed data hashes to" in tampered.stdout


def test_sft_steps_replay_with_their_rows_and_loss_masks(tmp_path: Path) -> None:
    tok = chat_tokenizer(tmp_path / "tok")
    rows = [{"messages": conversation(i, turns=1 + i % 2, system=i % 3 == 0)} for i in range(20)]
    chat = write_jsonl(tmp_path / "chat.jsonl", rows)
    run, capture = tmp_path / "run", tmp_path / "capture"
    cfg = tmp_path / "sft.toml"
    cfg.write_text(SFT.format(out=run, tok=tok, chat=chat) + ARCH)
    train_capturing(cfg, capture)

    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0}
    assert records[1]["progress/epoch"] < 1 < records[3]["progress/epoch"], "the steps should cross an epoch"
    for step in (1, 2, 3):
        batches = replayed(run, step)
        assert_same_batches(batches, captured(capture, step), step)
        assert sum(p.loss_tokens for b in batches for r in b.rows for p in r.pieces) == records[step]["loss/tokens"]

    listing = replay_json(run, 2, tmp_path, "--chars", "0", "--score")
    assert_scores_add_up(listing, records[2], checkpoint=1)
    docs = [d for mb in listing["micro_batches"] for row in mb["rows"] for d in row["documents"]]
    assert all(d["where"].startswith(f"{chat} line ") for d in docs)
    rows = chat.read_text().splitlines()
    for d in docs:
        line = int(d["where"].rsplit(" ", 1)[1])
        messages = json.loads(rows[line - 1])["messages"]
        trained = "".join(s["text"] for s in d["segments"] if s["loss"])
        # The trained text is the assistant turns; the prompts are shown but not trained on.
        assert all(m["content"] in trained for m in messages if m["role"] == "assistant"), d
        assert all(m["content"] not in trained for m in messages if m["role"] == "user"), d
    verified = run_cli(["replay", str(run), "--verify"])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # --document FILE:LINE finds a row in the steps whose replay holds it.
    where = docs[0]["where"]
    found = [(s, b.index) for s in (1, 2, 3) for b in replayed(run, s) for p in b.rows[0].pieces if p.where == where]
    asked = RunSteps(run).document_steps(where.replace(" line ", ":"))
    assert [(d["step"], d["micro_batch"]) for d in asked] == found
    assert (2, listing["micro_batches"][0]["index"]) in found


def test_replay_refuses_bad_requests_with_one_line(tmp_path: Path) -> None:
    missing = run_cli(["replay", str(tmp_path / "nowhere"), "--step", "1"])
    assert missing.returncode == 2 and "config.toml is missing" in missing.stderr
    no_step = run_cli(["replay", str(tmp_path)])
    assert no_step.returncode == 2 and "give --step N" in no_step.stderr
    zero = run_cli(["replay", str(tmp_path), "--step", "0"])
    assert zero.returncode == 2 and "steps count from 1" in zero.stderr
