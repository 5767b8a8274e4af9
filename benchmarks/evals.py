"""Validation throughput: tokens/s of `Validator.evaluate` against a plain forward of the same model over the same rows.

The script writes a held-out token folder of random documents (datatrove layout) and a `ctxcont` set file, with a
word-level tokenizer (EOS and the words w1, w2, ...), builds a Llama (d256 x 6 by default, fp32) with its vocabulary
from that tokenizer, and one `Validator` per set (`val.seq_lens = [L]`, `val.micro_batch_tokens = T`). In one
process, on the same model, it times:

- `validation`: `validator.evaluate(model, device)`, the whole round as the trainer runs it (for a token folder: the
  loss computed in forward with the fp32 LM head and cross-entropy in chunks of 1024 tokens; for a `ctxcont` set:
  each position's cross-entropy from the same fp32 chunked head, then the per-request sums).
- `plain`: `model(input_ids, position_ids, seq_lens)` under `torch.no_grad()` in eval mode (logits only) over the
  very rows the validator scores (`validator.rows[...]`, `validator.choices[...].rows`), each moved to the device
  as the validator moves it.

Tokens are row positions (the rows' `input_ids` elements) on both sides; the scored tokens (loss-mask positions)
are reported beside them. One warmup pass of everything, then `--repeats` timed passes, alternating which side
goes first; the median pass of each side counts. Target: validation tokens/s >= 0.9x the plain forward's.

To show where the time goes, each repeat also times the two LM heads alone on the cached final hidden states of
the held-out rows: the plain `lm_head` (logits) and the chunked fp32 head + cross-entropy the validation loss uses.

Both sides' results are checked once, untimed: the held-out loss from the plain logits equals `val/<set>/loss@L`,
and the `ctxcont` per-choice log-likelihoods from the plain logits equal the validator's.

torch's thread pool is sized to the machine, so other busy processes slow a pass several times over: before each
repeat the script waits (`--quiet-wait` seconds at most) for idle CPUs, and it reports the cores other processes
used during each side's timed passes.

    .venv/bin/python benchmarks/evals.py [--device cpu|cuda] [--repeats N] [--threads N] [--quiet-wait S]
                                         [--json PATH]
    .venv/bin/python benchmarks/evals.py --smoke      # tiny model and sets, one repeat (~10 s)

The script exits 0 when everything ran (it is a benchmark, not a test); PASS/MISS marks the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console

import common
from cpu_load import ForeignLoad, settle
from lmforge.config import FakeDataConfig
from lmforge.config.val import ValConfig
from lmforge.data.batch import MicroBatch
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.validation import SCORING_CHUNK, Validator
from lmforge.model import build_model
from lmforge.model.init import init_weights
from lmforge.model.llama import CausalLM
from lmforge.model.loss import IGNORE_INDEX, head_cross_entropy
from lmforge.parallel.model_setup import padded_vocab_size

TARGET = 0.9
"""Validation tokens/s must be at least this fraction of the plain forward's."""
SIDES = ("validation", "plain")
FOREIGN_LIMIT = 0.1
"""Cores of foreign load above which a side's figures are flagged as unreliable."""
HELDOUT, QUIZ = "heldout", "quiz"
"""Names of the token-folder set and the ctxcont set."""


@dataclass(frozen=True)
class Settings(common.ModelSettings):
    """Model, sets and measurement protocol."""

    vocab_size: int = 4096
    """Tokenizer size: EOS plus vocab_size - 1 words (the model's vocabulary is this rounded up to 128)."""
    seq_len: int = 512
    """Validation context length L."""
    row_tokens: int = 2048
    """Positions per scoring row (`val.micro_batch_tokens`)."""
    docs: int = 100
    mean_doc_len: int = 320
    """Held-out documents: lengths uniform in [2, 2 x mean_doc_len), EOS included."""
    items: int = 64
    choices: int = 4
    context_words: tuple[int, int] = (20, 200)
    continuation_words: tuple[int, int] = (2, 16)
    """ctxcont items: word counts drawn uniformly in [lo, hi)."""
    data_seed: int = 0
    repeats: int = 5
    threads: int = 2


SMOKE = common.tiny(
    Settings,
    vocab_size=512,
    seq_len=64,
    row_tokens=256,
    docs=24,
    mean_doc_len=40,
    items=8,
    context_words=(4, 30),
    continuation_words=(1, 8),
)
"""Small enough that a test runs the whole script in seconds."""


# ---------------------------------------------------------------------------------------------- inputs


def write_token_folder(folder: Path, docs: Sequence[np.ndarray]) -> None:
    """Documents as one datatrove shard: uint16 tokens, uint64 document ends, and the metadata file."""
    folder.mkdir(parents=True, exist_ok=True)
    np.concatenate(docs).astype("<u2").tofile(folder / "00000.ds")
    common.write_shard_index(folder / "00000.ds", np.cumsum([len(d) for d in docs]), "evals-benchmark")


def random_docs(s: Settings, rng: np.random.Generator) -> list[np.ndarray]:
    """Held-out documents of random words, each ending with EOS (id 0)."""
    lengths = rng.integers(2, 2 * s.mean_doc_len, size=s.docs)
    return [np.append(rng.integers(1, s.vocab_size, size=int(n) - 1), 0) for n in lengths]


def quiz_items(s: Settings, rng: np.random.Generator) -> tuple[list[dict[str, Any]], int]:
    """ctxcont rows of random words, and the continuation tokens they hold (one token per word)."""

    def words(bounds: tuple[int, int]) -> list[str]:
        return [f"w{i}" for i in rng.integers(1, s.vocab_size, size=int(rng.integers(*bounds)))]

    rows, scored = [], 0
    for i in range(s.items):
        continuations = [words(s.continuation_words) for _ in range(s.choices)]
        scored += sum(len(c) for c in continuations)
        rows.append(
            {
                "context": " ".join(words(s.context_words)),
                "continuations": [" " + " ".join(c) for c in continuations],
                "label": i % s.choices,
            }
        )
    return rows, scored


def build(s: Settings, vocab: int, attn: str, device: torch.device) -> CausalLM:
    """The Llama both sides run, initialized as training initializes it."""
    model = build_model(s.llama_arch(), padded_vocab_size(vocab), attn, device)
    init_weights(model, s.init_std, s.init_seed)
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------- timing


@torch.no_grad()
def plain_pass(model: CausalLM, rows: Sequence[MicroBatch], device: torch.device) -> None:
    """The plain forward: logits of every row, nothing else."""
    for batch in rows:
        mb = batch.to(device)
        model(mb.input_ids, mb.position_ids, mb.doc_lens)


class Clock:
    """Wall and foreign-CPU time of one side's timed passes."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.foreign_s = 0.0

    def time(self, fn: Callable[[], object], device: torch.device) -> None:
        """Run `fn` once and add its wall time and the CPU time other processes spent meanwhile."""
        common.sync(device)
        load, t0 = ForeignLoad(), time.perf_counter()
        fn()
        common.sync(device)
        wall = time.perf_counter() - t0
        self.foreign_s += max(load.cpu_s(), 0.0)
        self.seconds.append(wall)

    def figures(self, positions: int) -> dict[str, Any]:
        """Median pass, tokens/s over `positions` and the mean foreign cores."""
        median = statistics.median(self.seconds)
        return {
            "seconds": self.seconds,
            "median_s": median,
            "tokens_per_s": positions / median,
            "foreign_cores": self.foreign_s / sum(self.seconds),
        }


# ---------------------------------------------------------------------------------------------- checks


@torch.no_grad()
def plain_heldout_loss(model: CausalLM, rows: Sequence[MicroBatch], device: torch.device) -> float:
    """Mean cross-entropy over the loss-mask positions, from the plain logits (float64 sum)."""
    total, count = 0.0, 0
    for batch in rows:
        mb = batch.to(device)
        logits = model(mb.input_ids, mb.position_ids, mb.doc_lens)[0].float()
        targets = mb.target_ids[0].masked_fill(~mb.loss_mask[0], IGNORE_INDEX)
        total += float(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum").double())
        count += int(batch.loss_mask.sum())
    return total / count


@torch.no_grad()
def plain_loglik(model: CausalLM, rows: Sequence[Any], n_requests: int, device: torch.device) -> np.ndarray:
    """Each request's summed log-likelihood from the plain logits (float64, on the host)."""
    totals = np.zeros(n_requests + 1)
    for row in rows:
        mb = row.batch.to(device)
        logp = torch.log_softmax(model(mb.input_ids, mb.position_ids, mb.doc_lens)[0].double(), dim=-1)
        picked = logp.gather(-1, mb.target_ids[0, :, None])[:, 0].cpu().numpy()
        np.add.at(totals, np.where(row.request_ids >= 0, row.request_ids, n_requests), picked)
    return totals[:n_requests]


# ---------------------------------------------------------------------------------------------- run


def run(s: Settings, device: torch.device, attn: str, quiet_wait: float, work: Path) -> dict[str, Any]:
    """Write the sets, build the model and validators, time both sides and check their results."""
    rng = np.random.default_rng(s.data_seed)
    tokenizer = load_tokenizer(common.write_word_tokenizer(work / "tokenizer", s.vocab_size))
    docs = random_docs(s, rng)
    write_token_folder(work / HELDOUT, docs)
    items, quiz_scored = quiz_items(s, rng)
    (work / "sets").mkdir()
    (work / "sets" / f"{QUIZ}.ctxcont.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))

    data = FakeDataConfig(seq_len=s.seq_len, batch_tokens=s.row_tokens, micro_batch_tokens=s.row_tokens,
                          vocab_size=tokenizer.size)  # fmt: skip
    scoring = {"seq_lens": [s.seq_len], "micro_batch_tokens": s.row_tokens}
    heldout_cfg = ValConfig.model_validate({**scoring, "sets": [{"name": HELDOUT, "path": str(work / HELDOUT)}]})
    quiz_cfg = ValConfig.model_validate({**scoring, "sets": [QUIZ], "data_dir": str(work / "sets")})
    validators = {
        HELDOUT: Validator(heldout_cfg, data, tokenizer, rank=0, world_size=1),
        QUIZ: Validator(quiz_cfg, data, tokenizer, rank=0, world_size=1),
    }
    choice = validators[QUIZ].choices[(QUIZ, s.seq_len)]
    rows = {
        HELDOUT: [r.batch for r in validators[HELDOUT].rows[(HELDOUT, s.seq_len)]],
        QUIZ: [r.batch for r in choice.rows],
    }
    model = build(s, tokenizer.size, attn, device)

    # The heads alone, on the held-out rows' final hidden states: what the two sides do differently there.
    with torch.no_grad():
        hidden = []
        for batch in rows[HELDOUT]:
            mb = batch.to(device)
            targets = mb.target_ids[0].masked_fill(~mb.loss_mask[0], IGNORE_INDEX)
            hidden.append((model.model(mb.input_ids, mb.position_ids, mb.doc_lens)[0], targets))

    def head_logits() -> None:
        with torch.no_grad():
            for h, _ in hidden:
                model.lm_head(h)

    def head_chunked_ce() -> None:
        with torch.no_grad():
            for h, t in hidden:
                head_cross_entropy(h, model.lm_head.weight, t, SCORING_CHUNK)

    passes: dict[tuple[str, str], Callable[[], object]] = {}
    for name, validator in validators.items():
        passes[(name, "validation")] = lambda v=validator: v.evaluate(model, device)
        passes[(name, "plain")] = lambda r=rows[name]: plain_pass(model, r, device)
    heads = {"logits": head_logits, "chunked_ce": head_chunked_ce}

    for fn in [*passes.values(), *heads.values()]:  # warmup: allocator, thread pool, kernels
        fn()
        common.sync(device)
    clocks = {key: Clock() for key in [*passes, *((h, "head") for h in heads)]}
    quiet_before = []
    for r in range(s.repeats):
        if quiet_wait > 0:
            quiet_before.append(settle(quiet_wait))
        for name in validators:
            for side in common.in_turn(SIDES, r):
                clocks[(name, side)].time(passes[(name, side)], device)
        for h in common.in_turn(list(heads), r):
            clocks[(h, "head")].time(heads[h], device)

    metrics = validators[HELDOUT].evaluate(model, device)
    loss_plain = plain_heldout_loss(model, rows[HELDOUT], device)
    arrays = work / "arrays"
    quiz_metrics = validators[QUIZ].evaluate(model, device, arrays)
    loglik_val = np.load(arrays / f"{QUIZ}@{s.seq_len}.npz")["loglik"]
    loglik_plain = plain_loglik(model, choice.rows, len(choice.requests), device)

    sets: dict[str, Any] = {}
    for name in validators:
        positions = sum(int(b.input_ids.numel()) for b in rows[name])
        sides = {side: clocks[(name, side)].figures(positions) for side in SIDES}
        ratio = sides["validation"]["tokens_per_s"] / sides["plain"]["tokens_per_s"]
        sets[name] = {
            "rows": len(rows[name]),
            "positions": positions,
            "scored_tokens": sum(int(b.loss_mask.sum()) for b in rows[name]),
            **sides,
            "ratio": ratio,
            "pass": ratio >= TARGET,
        }
    sets[HELDOUT].update(
        doc_lengths=[len(d) for d in docs],
        loss=metrics[f"val/{HELDOUT}/loss@{s.seq_len}"],
        plain_loss=loss_plain,
        loss_diff=abs(metrics[f"val/{HELDOUT}/loss@{s.seq_len}"] - loss_plain),
    )
    sets[QUIZ].update(
        requests=len(choice.requests),
        expected_scored_tokens=quiz_scored,
        acc=quiz_metrics[f"val/{QUIZ}/acc@{s.seq_len}"],
        loglik_diff=float(np.abs(loglik_val - loglik_plain).max()),
    )
    head_positions = sets[HELDOUT]["positions"]
    return {
        "settings": asdict(s),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "model_vocab": model.lm_head.weight.shape[0],
        "target": TARGET,
        "sets": sets,
        "heads": {h: clocks[(h, "head")].figures(head_positions) for h in heads},
        "quiet_before": quiet_before,
    }


# ---------------------------------------------------------------------------------------------- report


def print_report(figures: dict[str, Any], console: Console) -> None:
    """The per-set table (both sides, the ratio against the target), the heads alone and the checks."""
    s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in figures["settings"].items()})
    title = (
        f"validation vs plain forward: Llama d{s.hidden_size} x{s.num_hidden_layers}, vocab {figures['model_vocab']}, "
        f"L {s.seq_len}, rows of {s.row_tokens}, fp32, {figures['device']}, {figures['threads']} threads, "
        f"median of {s.repeats}"
    )
    columns = ("set", "side", "rows", "positions", "scored", "median s", "tokens/s", "foreign cores")
    table = common.result_table(title, columns, left={"set", "side"})
    for name, f in figures["sets"].items():
        for side in SIDES:
            g = f[side]
            cells = [str(f["rows"]), f"{f['positions']:,}", f"{f['scored_tokens']:,}"] if side == SIDES[0] else [""] * 3
            table.add_row(name if side == SIDES[0] else "", side, *cells, f"{g['median_s']:.4f}",
                          f"{g['tokens_per_s']:,.0f}", f"{g['foreign_cores']:.2f}")  # fmt: skip
        table.add_row("", "validation / plain", "", "", "", "", f"{f['ratio']:.3f}x {common.verdict(f['pass'])}", "")
        table.add_section()
    console.print(table)
    heads = figures["heads"]
    console.print(
        f"LM head alone on the held-out rows' hidden states: logits {heads['logits']['median_s']:.4f} s, "
        f"chunked fp32 head + cross-entropy (validation's) {heads['chunked_ce']['median_s']:.4f} s"
    )
    h, q = figures["sets"][HELDOUT], figures["sets"][QUIZ]
    console.print(
        f"checks: held-out loss {h['loss']:.6f} (plain logits: {h['plain_loss']:.6f}, diff {h['loss_diff']:.1e}); "
        f"{QUIZ} log-likelihoods max diff {q['loglik_diff']:.1e}, acc {q['acc']:.3f}, scored {q['scored_tokens']:,} "
        f"of {q['expected_scored_tokens']:,} continuation tokens"
    )
    contended = [f"{n}/{side}" for n, f in figures["sets"].items() for side in SIDES
                 if f[side]["foreign_cores"] > FOREIGN_LIMIT]  # fmt: skip
    if contended:
        console.print(
            f"[yellow]other processes used the CPUs during {', '.join(contended)} (> {FOREIGN_LIMIT} cores): "
            "the figures are not reliable; rerun on an idle machine[/]"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    presets = {"default": Settings(), "smoke": SMOKE}
    p = common.benchmark_parser(__doc__, presets, "tiny model and sets, one repeat", quiet_wait="before each repeat")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--attn", default="auto", help="attention backend (default: auto, the device's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, print the table, optionally write the JSON."""
    args = parse_args(argv)
    settings = common.with_flags(SMOKE if args.smoke else Settings(), args)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(settings.threads)
    with tempfile.TemporaryDirectory(prefix="lmforge-evals-") as tmp:
        figures = run(settings, device, args.attn, common.quiet_wait_s(args), Path(tmp))
    print_report(figures, common.make_console(140))
    common.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
