"""Under `val.convention = "lmeval"`, in-loop validation gives lm-evaluation-harness's numbers.

A small model is trained with lmforge, scoring three sets converted from harness task files (`lmforge val-sets
TASK.yaml`) under both conventions, and exported; the real harness (`lm_eval --model hf`, offline, CPU, fp32) then
scores the same task files on the exported folder. Per-choice and per-text log-likelihoods agree within 1e-4 and
the accuracies are equal. The items include contexts cut mid-word, non-ASCII text, empty contexts (minimal pairs)
and a tied pair. Run with `-s` to see both conventions next to the harness.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmforge.data.tokenizer import load_tokenizer
from lmforge.monitor import read_metrics
from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe
from tests.chat import write_jsonl
from tests.conftest import require
from tests.integration.runner import TINY_ARCH, env_one_thread, run_cli
from tests.shards import write_shard

require("lm_eval")
pytestmark = pytest.mark.slow

SENTENCE = (
    "the king speaks and the queen answers why do you ask what is the weather today in the old town where café "
    "owners serve naïve guests größere portions of crème brûlée while señor Ødegaard reads 東京 news every morning "
    "before the market opens"
)
WORDS = SENTENCE.split()
MAX_LENGTH = 32  # short enough that long contexts are cut from the left and long texts take several windows
STEPS = 40


def _sentence(rng: np.random.Generator, n: int) -> str:
    start = int(rng.integers(0, len(WORDS)))
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(n))


def _harness_data(folder: Path) -> None:
    """Data files in the harness's usual layouts, and task files that read them."""
    rng = np.random.default_rng(7)
    mc = []
    for i in range(30):
        context = _sentence(rng, int(rng.integers(2, 30)))
        if i % 3 == 0:  # cut mid-word: the continuation completes a word
            word = WORDS[int(rng.integers(0, len(WORDS)))]
            cut = max(1, len(word) // 2)
            context += " " + word[:cut]
            choices = [word[cut:] + " " + _sentence(rng, 5) for _ in range(3)]
        else:
            choices = [" " + _sentence(rng, int(rng.integers(1, 4))) for _ in range(2 + i % 3)]
        if i % 5 == 1:
            context += " "  # whitespace at the end moves to the continuations
        mc.append({"query": context, "choices": choices, "gold": int(rng.integers(0, len(choices)))})
    write_jsonl(folder / "mc.jsonl", mc)
    pairs = []
    for i in range(30):
        good = _sentence(rng, int(rng.integers(3, 9)))
        words = good.split()
        rng.shuffle(words)
        pairs.append({"sentence_good": good, "sentence_bad": good if i == 0 else " ".join(words)})  # one tie
    write_jsonl(folder / "pairs.jsonl", pairs)
    write_jsonl(folder / "ppl.jsonl", [{"text": _sentence(rng, int(rng.integers(1, 60)))} for _ in range(20)])
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    tasks = {
        "lmf_mc": "output_type: multiple_choice\ndoc_to_text: '{{{{query}}}}'\ndoc_to_choice: choices\n"
        "doc_to_target: gold\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "lmf_pairs": "output_type: multiple_choice\ndoc_to_text: ''\ndoc_to_target: 0\n"
        "doc_to_choice: '{{{{[sentence_good, sentence_bad]}}}}'\nmetric_list:\n  - metric: acc\n",
        "lmf_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: text\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    }
    for task, body in tasks.items():
        data = folder / f"{task.removeprefix('lmf_')}.jsonl"
        (folder / f"{task}.yaml").write_text(f"task: {task}\n" + common.format(data=data) + body.format())


def _train_and_export(tmp: Path) -> tuple[Path, Path]:
    """Convert the tasks, train with both conventions scored at the end, export; (run dir, exported folder)."""
    rng = np.random.default_rng(0)
    texts = [_sentence(rng, int(rng.integers(5, 40))) for _ in range(400)]
    save_tokenizer_folder(train_bpe(texts, vocab_size=600, min_frequency=1), tmp / "tok")
    tok = load_tokenizer(tmp / "tok")
    docs = [[*tok.tokenizer.encode(t, add_special_tokens=False).ids, tok.eos_id] for t in texts]
    write_shard(tmp / "shards", "00000", docs)
    sets = []
    for task in ("mc", "pairs", "ppl"):
        for suffix, convention in (("", "lmeval"), ("_lmforge", "lmforge")):
            args = ["val-sets", str(tmp / "harness" / f"lmf_{task}.yaml"), "--output", str(tmp / "sets")]
            result = run_cli([*args, "--name", task + suffix])
            assert result.returncode == 0, result.stderr[-2000:]
            sets.append(f'{{name = "{task}{suffix}", convention = "{convention}"}}')
    config = tmp / "run.toml"
    config.write_text(f"""
max_steps = {STEPS}
output_dir = "{(tmp / "run").as_posix()}"
[tokenizer]
name = "{(tmp / "tok").as_posix()}"
{TINY_ARCH}
[data]
type = "tokens"
paths = ["{(tmp / "shards").as_posix()}"]
seq_len = 64
batch_tokens = 512
micro_batch_tokens = 256
max_epochs = 10
[optim]
lr = 1e-2
[val]
seq_lens = [{MAX_LENGTH}]
micro_batch_tokens = 128
data_dir = "{(tmp / "sets").as_posix()}"
sets = [{", ".join(sets)}]
save_arrays = true
""")
    result = run_cli(["train", "@", str(config)])
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(["export", str(tmp / "run"), "--output", str(tmp / "hf"), "--dtype", "float32"])
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run", tmp / "hf"


def _run_harness(tmp: Path, model: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The harness's results and its per-document samples, by task.

    Its logits cache is off: with it on and batches of 8, lm-eval 0.4.13 scored one rolling window of this data
    wrongly (a text's log-likelihood -143.0 where batches of 1 or 2, the cache off, and transformers alone all give
    -10.545); the cache only saves forwards, so turning it off changes no correct number."""
    env = {**env_one_thread(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf_home"),
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--device", "cpu", "--batch_size", "8",
           "--model_args", f"pretrained={model},dtype=float32,max_length={MAX_LENGTH},logits_cache=False",
           "--tasks", "lmf_mc,lmf_pairs,lmf_ppl", "--include_path", str(tmp / "harness"),
           "--output_path", str(tmp / "harness_out"), "--log_samples"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = glob.glob(str(tmp / "harness_out" / "**" / "results_*.json"), recursive=True)
    samples = {}
    for task in ("lmf_mc", "lmf_pairs", "lmf_ppl"):
        (path,) = glob.glob(str(tmp / "harness_out" / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return json.loads(Path(results_file).read_text())["results"], samples


def test_lmeval_convention_equals_the_harness(tmp_path: Path) -> None:
    (tmp_path / "harness").mkdir()
    _harness_data(tmp_path / "harness")
    run, model = _train_and_export(tmp_path)
    results, samples = _run_harness(tmp_path, model)
    (ours,) = [r for r in read_metrics(run / "metrics.jsonl") if "time/val" in r]
    assert ours["step"] == STEPS
    arrays = run / "val_arrays" / f"step_{STEPS}"
    at = f"@{MAX_LENGTH}"

    for task in ("mc", "pairs"):
        theirs = np.array([float(ll) for s in samples[f"lmf_{task}"] for ll, _ in s["filtered_resps"]])
        mine = np.load(arrays / f"{task}{at}.npz")["loglik"]
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-4)
    theirs = np.array([float(s["filtered_resps"][0]) for s in samples["lmf_ppl"]])
    np.testing.assert_allclose(np.load(arrays / f"ppl{at}.npz")["loglik"], theirs, rtol=0, atol=1e-4)

    assert ours[f"val/mc/acc{at}"] == results["lmf_mc"]["acc,none"]
    assert ours[f"val/mc/acc_norm{at}"] == results["lmf_mc"]["acc_norm,none"]
    assert ours[f"val/pairs/acc{at}"] == results["lmf_pairs"]["acc,none"]
    for metric, key in (("word_perplexity", "word_perplexity"), ("byte_perplexity", "byte_perplexity"),
                        ("bpb", "bits_per_byte")):  # fmt: skip
        assert ours[f"val/ppl/{metric}{at}"] == pytest.approx(results["lmf_ppl"][f"{key},none"], rel=1e-5)
    # the tied pair counts as right in both, and the model is not guessing
    assert samples["lmf_pairs"][0]["acc"] == 1.0
    assert 0.5 < ours[f"val/pairs/acc{at}"] <= 1.0

    rows = [
        ("ctxcont acc", "mc_lmforge", "mc", "acc", "lmf_mc", "acc,none"),
        ("ctxcont acc_norm", "mc_lmforge", "mc", "acc_norm", "lmf_mc", "acc_norm,none"),
        ("pairs acc", "pairs_lmforge", "pairs", "acc", "lmf_pairs", "acc,none"),
        ("ppl bpb", "ppl_lmforge", "ppl", "bpb", "lmf_ppl", "bits_per_byte,none"),
    ]
    print(f"\n| | lmforge | lmforge, lmeval convention | lm-eval {_version()} |\n|---|---|---|---|")
    for label, lmf, lme, metric, task, key in rows:
        print(f"| {label} | {ours[f'val/{lmf}/{metric}{at}']:.4f} | {ours[f'val/{lme}/{metric}{at}']:.4f} | "
              f"{results[task][key]:.4f} |")  # fmt: skip


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
