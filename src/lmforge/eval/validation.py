"""Validation on held-out token folders and `ppl` set files (loss, perplexity and bits per byte at several
context lengths), on `ctxcont` and `pairs` set files (accuracy by log-likelihood, see `lmforge.eval`), and on SFT's
held-out samples (`val.data`: loss and perplexity over their loss tokens).

A held-out token folder written by `lmforge mix` is also scored per source: its documents are grouped by the
source they came from and each group is scored as a set of its own, `val/<set>/<source>/<metric>@<length>`; the
whole set's figures are the sums over its sources (every document is scored once).

Every document of a set is cut into consecutive chunks of L tokens (L in `val.seq_lens`); within a chunk each
token after the first is scored given the ones before it, so every token of the set except the first of each chunk
is scored exactly once. Chunks are packed as separate segments (document masking) into rows of exactly
`val.micro_batch_tokens` inputs, padded with an unscored segment, so compiled blocks see one shape. Held-out SFT
samples are packed in file order the way training packs them (one segment each, unscored padding). Rows are dealt
round-robin to the ranks; the sums are all-reduced, so results do not depend on the world size. The training
model scores them (no copy) under `torch.no_grad`, with the LM head in fp32; nothing of the training state
(weights, optimizer, data position, RNG) changes.

Set files under `val.convention = "lmeval"` follow lm-evaluation-harness's rules instead (`lmforge.eval.harness`):
their choices, and a ppl set's rolling windows, are scored as requests, like lmforge's own ctxcont sets.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lmforge.config.data import DataConfig, SFTDataConfig
from lmforge.config.loader import ConfigError
from lmforge.config.val import ValConfig, ValSetConfig
from lmforge.data.batch import MicroBatch, Window, pack_windows, padding_window
from lmforge.data.packing import fill_bins
from lmforge.data.sft import SampleSet, load_samples
from lmforge.data.shards import ShardPool
from lmforge.data.sources import SourceMap
from lmforge.data.tokenizer import TokenizerInfo
from lmforge.data.tokens import check_shards, check_token_ids
from lmforge.eval.harness import count_words, harness_requests, rolling_metrics, rolling_requests, text_logliks
from lmforge.eval.scoring import ScoringRow, pack_requests, score_requests
from lmforge.eval.sets import EvalSet, Request, build_requests, fit_requests, ppl_tokens, read_eval_dir, set_metrics
from lmforge.model.loss import IGNORE_INDEX
from lmforge.parallel.context import ContextShard, chunk_positions, shard_micro_batch

SCORING_CHUNK = 1024
"""Tokens per LM-head chunk while scoring: fp32 logits without holding them all."""


def token_bytes(tokenizer: TokenizerInfo) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens such as EOS).

    With a byte-level tokenizer every character of a token's string encodes one byte, so the count is exact;
    otherwise each token is decoded alone (exact for tokens that decode to whole characters)."""
    tok = tokenizer.tokenizer
    size = tok.get_vocab_size(with_added_tokens=True)
    special = {int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}
    byte_level = "ByteLevel" in type(tok.decoder).__name__ if tok.decoder is not None else False
    counts = np.zeros(size, dtype=np.int64)
    for i in range(size):
        if i in special:
            continue
        piece = tok.id_to_token(i)
        if piece is None:
            continue
        counts[i] = len(piece) if byte_level else len(tok.decode([i]).encode("utf-8"))
    return counts


@dataclass
class _Row:
    batch: MicroBatch
    scored_bytes: int


def chunk_rows(tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, row_tokens: int,
               nbytes: np.ndarray) -> list[_Row]:  # fmt: skip
    """The scoring rows of one set at context length `seq_len` (see the module docstring)."""
    bounds = np.concatenate([[0], doc_starts, [len(tokens)]]).astype(np.int64)
    windows: list[Window] = []
    for lo, hi in itertools.pairwise(bounds):
        for start in range(int(lo), int(hi), seq_len):
            chunk = tokens[start : min(start + seq_len, int(hi))]
            if len(chunk) >= 2:
                windows.append(Window(chunk, [len(chunk) - 1]))
    rows: list[_Row] = []
    current: list[Window] = []
    used = 0
    for w in [*windows, None]:
        n = 0 if w is None else len(w.tokens) - 1
        if current and (w is None or used + n > row_tokens):
            pad = row_tokens - used
            if pad:
                current.append(padding_window(pad))
            batch = pack_windows(current)
            rows.append(_Row(batch, scored_bytes(batch, nbytes)))
            current, used = [], 0
        if w is not None:
            current.append(w)
            used += n
    return rows


def scored_bytes(batch: MicroBatch, nbytes: np.ndarray) -> int:
    """UTF-8 bytes the scored targets of a row stand for (`nbytes` from `token_bytes`)."""
    return int(nbytes[batch.target_ids[batch.loss_mask].numpy()].sum())


def split_by_source(name: str, tokens: np.ndarray, doc_starts: np.ndarray, doc_sources: np.ndarray,
                    source_names: tuple[str, ...]) -> list[tuple[str, np.ndarray, np.ndarray]]:  # fmt: skip
    """The documents of a set (`tokens` with `doc_starts` inside it) grouped by source, each group as
    (`<name>/<source>`, its tokens, its document starts); sources without documents are left out."""
    lengths = np.diff(np.concatenate([[0], doc_starts, [len(tokens)]]).astype(np.int64))
    token_sources = np.repeat(doc_sources, lengths)
    groups = []
    for index, source in enumerate(source_names):
        mine = doc_sources == index
        if mine.any():
            groups.append((f"{name}/{source}", tokens[token_sources == index], np.cumsum(lengths[mine])[:-1]))
    return groups


def sample_rows(samples: SampleSet, row_tokens: int) -> list[_Row]:
    """Held-out SFT samples packed in order into scoring rows of `row_tokens` positions."""
    bins = fill_bins(samples.positions.tolist(), row_tokens)
    return [_Row(samples.micro_batch(b, row_tokens), 0) for b in bins]


SAMPLES = -1
"""The context-length slot of SFT's held-out samples, which are scored whole."""


@dataclass
class _RequestRows:
    """A set scored request by request at one context length (ctxcont and pairs sets; ppl sets under the lmeval
    convention, one request per rolling window): its requests and their scoring rows."""

    set: EvalSet
    convention: str
    requests: list[Request]
    rows: list[ScoringRow]

    def metrics(self, loglik: np.ndarray) -> dict[str, float]:
        """The set's metrics from the per-request log-likelihoods."""
        if self.set.kind == "ppl":
            return rolling_metrics(self.set.texts, self.requests, loglik)
        return set_metrics(self.set.kind, self.set.items, self.requests, loglik, self.convention)

    def save(self, path: Path, loglik: np.ndarray) -> None:
        """Per-choice log-likelihoods with their item, choice, continuation bytes and characters, and the items'
        labels; for a ppl set, each text's log-likelihood with its words and bytes. Written under a temporary name
        and renamed, so a killed run never leaves a partial file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.set.kind == "ppl":
            texts = self.set.texts
            arrays = {
                "loglik": text_logliks(self.requests, loglik, len(texts)),
                "words": np.asarray([count_words(t) for t in texts]),
                "nbytes": np.asarray([len(t.encode("utf-8")) for t in texts]),
            }
        else:
            arrays = {
                "loglik": loglik,
                "item": np.asarray([r.item for r in self.requests]),
                "choice": np.asarray([r.choice for r in self.requests]),
                "nbytes": np.asarray([r.nbytes for r in self.requests]),
                "nchars": np.asarray([r.nchars for r in self.requests]),
                "label": np.asarray([item.label for item in self.set.items]),
            }
        partial = path.with_name(f".tmp_{path.name}")
        with partial.open("wb") as f:
            np.savez(f, **arrays)
        os.replace(partial, path)


class Validator:
    """Scores the configured held-out sets with a model: the training model (through the trainer's validation
    callback) or a snapshot loaded by the eval worker."""

    def __init__(self, cfg: ValConfig, data: DataConfig, tokenizer: TokenizerInfo | None, rank: int,
                 world_size: int, shard: ContextShard | None = None, counted: bool = True) -> None:  # fmt: skip
        """Read and chunk every set once; `data` gives the defaults and, for `val.data`, the sample rules. Rows
        are dealt over `world_size` data-parallel ranks; under context parallelism (`shard`), every rank of a CP
        group scores the same rows, each its own chunks of them. Under tensor parallelism every rank of a TP group
        scores the same rows, and only the first counts them (`counted`)."""
        self.cfg = cfg
        self.counted = counted
        self.rank, self.world_size = rank, world_size
        self.shard = shard if shard is not None else ContextShard(None, 0, 1)
        self.seq_lens = cfg.seq_lens or [data.seq_len]
        row_tokens = cfg.micro_batch_tokens or data.micro_batch_tokens
        if max(self.seq_lens) > row_tokens + 1:
            raise ConfigError(f"val.seq_lens {self.seq_lens} must not exceed val.micro_batch_tokens + 1 ({row_tokens})")
        if tokenizer is None:
            raise ConfigError("validation needs tokenizer.name (bits per byte count the bytes each token stands for)")
        self.rows: dict[tuple[str, int], list[_Row]] = {}
        self.choices: dict[tuple[str, int], _RequestRows] = {}
        self.combined: dict[tuple[str, int], list[tuple[str, int]]] = {}
        """A mixture set's (name, length) -> its sources' keys in `rows`, whose sums make the whole set's."""
        nbytes = token_bytes(tokenizer) if cfg.sets else np.zeros(0, dtype=np.int64)
        files = {s.name: s for s in read_eval_dir(cfg.data_dir)} if cfg.data_dir else {}
        conventions = dict(cfg.files())
        for s in cfg.sets:
            if not isinstance(s, ValSetConfig):
                name = s if isinstance(s, str) else s.name
                self._add_set_file(name, conventions[name], files, tokenizer, row_tokens, nbytes)
                continue
            pool = ShardPool([Path(s.path)])
            # The checks training data gets: EOS and token size (another tokenizer), ids inside the vocabulary.
            check_shards(pool, tokenizer)
            tokens, doc_starts, _ = pool.read(0, pool.num_tokens)
            check_token_ids(pool, tokens, 0, tokenizer.size)
            sources = SourceMap.for_pool(pool, [Path(s.path)])
            groups = [(s.name, tokens, doc_starts)] if sources is None else split_by_source(
                s.name, tokens, doc_starts, sources.document_sources(), sources.names
            )  # fmt: skip
            for seq_len in self.seq_lens:
                for name, group_tokens, group_starts in groups:
                    self.rows[(name, seq_len)] = chunk_rows(group_tokens, group_starts, seq_len, row_tokens, nbytes)
                if sources is not None:
                    self.combined[(s.name, seq_len)] = [(name, seq_len) for name, _, _ in groups]
        if cfg.data:
            assert isinstance(data, SFTDataConfig), "val.data needs data.type = 'sft' (checked with the config)"
            if row_tokens < data.seq_len:
                raise ConfigError(f"val.micro_batch_tokens ({row_tokens}) must hold a sample of data.seq_len tokens")
            self.samples = load_samples(cfg.data, tokenizer, data)
            self.rows[("", SAMPLES)] = sample_rows(self.samples, row_tokens)
        if self.shard.size > 1:
            self._split_rows(row_tokens, nbytes)

    def _split_rows(self, row_tokens: int, nbytes: np.ndarray) -> None:
        """Keep this CP rank's chunks of every row (see `lmforge.parallel.context`), with the bytes its own scored
        tokens stand for."""
        if row_tokens % (2 * self.shard.size):
            raise ConfigError(
                f"val.micro_batch_tokens ({row_tokens}) does not split into 2 x parallel.cp = {2 * self.shard.size} "
                "equal chunks"
            )
        for key, rows in self.rows.items():
            split = [shard_micro_batch(r.batch, self.shard) for r in rows]
            self.rows[key] = [_Row(b, scored_bytes(b, nbytes) if len(nbytes) else 0) for b in split]
        index = chunk_positions(row_tokens, self.shard.rank, self.shard.size)
        for choice in self.choices.values():
            rows = choice.rows
            choice.rows = [ScoringRow(shard_micro_batch(r.batch, self.shard), r.request_ids[index]) for r in rows]

    def _add_set_file(self, name: str, convention: str, files: dict[str, EvalSet], tokenizer: TokenizerInfo,
                      row_tokens: int, nbytes: np.ndarray) -> None:  # fmt: skip
        if name not in files:
            raise ConfigError(f"val.sets names {name!r}, but val.data_dir {self.cfg.data_dir} holds {sorted(files)}")
        evs = files[name]
        if convention == "lmeval":
            self._add_harness_set(evs, tokenizer, row_tokens)
            return
        if evs.kind == "ppl":
            tokens, doc_starts = ppl_tokens(evs.texts, tokenizer)
            for seq_len in self.seq_lens:
                self.rows[(name, seq_len)] = chunk_rows(tokens, doc_starts, seq_len, row_tokens, nbytes)
            return
        requests = build_requests(evs.items, tokenizer)
        for seq_len in self.seq_lens:
            # A chunk of L tokens is the context length L of token sets; a request gets the same L tokens.
            fitted = fit_requests(requests, seq_len - 1, evs.items)
            self.choices[(name, seq_len)] = _RequestRows(evs, "lmforge", fitted, pack_requests(fitted, row_tokens))

    def _add_harness_set(self, evs: EvalSet, tokenizer: TokenizerInfo, row_tokens: int) -> None:
        """A set file under the lmeval convention: at context length L (the harness's max_length) a request has
        at most L + 1 tokens, L scored positions."""
        if max(self.seq_lens) > row_tokens:
            raise ConfigError(
                f"val.seq_lens {self.seq_lens} must not exceed val.micro_batch_tokens ({row_tokens}) for set "
                f"{evs.name!r}: under the lmeval convention a context length L scores L positions in one row"
            )
        requests = [] if evs.kind == "ppl" else harness_requests(evs.items, tokenizer)
        for seq_len in self.seq_lens:
            if evs.kind == "ppl":
                fitted = rolling_requests(evs.texts, tokenizer, seq_len)
            else:
                fitted = fit_requests(requests, seq_len, evs.items)
            rows = pack_requests(fitted, row_tokens)
            self.choices[(evs.name, seq_len)] = _RequestRows(evs, "lmeval", fitted, rows)

    def arrays_dir(self, run_dir: Path, step: int) -> Path | None:
        """Where the first rank writes the per-choice (or, for ppl sets under the lmeval convention, per-text)
        scores of step `step` (None: `val.save_arrays` off, no such set, or another rank: every rank of a CP or TP
        group holds the same scores, and only one may write them)."""
        if not self.cfg.save_arrays or not self.choices or self.rank != 0 or self.shard.rank != 0 or not self.counted:
            return None
        return Path(run_dir) / "val_arrays" / f"step_{step}"

    @torch.no_grad()
    def token_sums(self, model: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """float64 [len(self.rows), 3] on the device: this rank's loss sum, scored tokens and scored bytes of each
        (set, length) of `self.rows`, in its order. The model is called as it is (`evaluate` sets its mode and
        chunking); nothing is read on the host."""
        sums = []
        for rows in self.rows.values():
            loss = torch.zeros((), device=device, dtype=torch.float64)
            tokens = scored_bytes = 0
            # Every rank runs the same number of forwards (FSDP all-gathers in each); a rank without a row of its
            # own scores a copy of row 0 and counts nothing from it.
            for turn in range(math.ceil(len(rows) / self.world_size)):
                i = turn * self.world_size + self.rank
                own = i < len(rows)
                row = rows[i if own else 0]
                mb = row.batch.to(device)
                targets = mb.target_ids.masked_fill(~mb.loss_mask, IGNORE_INDEX)
                value = model(mb.input_ids, mb.position_ids, mb.doc_lens, targets=targets)
                if own:
                    loss += value.double()
                    tokens += int(row.batch.loss_mask.sum())  # the host copy: no device read
                    scored_bytes += row.scored_bytes
            counts = torch.tensor([float(tokens), float(scored_bytes)], device=device, dtype=torch.float64)
            sums.append(torch.cat([loss.reshape(1), counts]))
        return torch.stack(sums) if sums else torch.zeros(0, 3, dtype=torch.float64, device=device)

    def evaluate(self, model: torch.nn.Module, device: torch.device, arrays: Path | None = None) -> dict[str, float]:
        """One round over every set and context length: `val/<set>/{loss,ppl,bpb}@<L>`, `val/<set>/acc@<L>` (and
        `acc_norm` for ctxcont), `val/loss` and `val/perplexity` (held-out samples), and `time/val`. With `arrays`,
        the choice sets' per-choice scores are written there."""
        t0 = time.perf_counter()
        was_training, chunk = model.training, getattr(model, "loss_chunk_tokens", 0)
        model.eval()
        model.loss_chunk_tokens = SCORING_CHUNK  # fp32 logits, chunk by chunk
        try:
            total = self.token_sums(model, device)
            logliks = {
                key: score_requests(
                    model, choice.rows, len(choice.requests), device, self.rank, self.world_size, self.counted
                )
                for key, choice in self.choices.items()
            }
        finally:
            model.loss_chunk_tokens = chunk
            model.train(was_training)
        if not self.counted:
            total.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        out: dict[str, float] = {}
        results = dict(zip(self.rows, total.tolist(), strict=True))
        for key, parts in self.combined.items():
            results[key] = [sum(values) for values in zip(*(results[p] for p in parts), strict=True)]
        for (name, seq_len), (loss_sum, count, nbytes) in results.items():
            mean = loss_sum / max(count, 1.0)
            if seq_len == SAMPLES:
                out["val/loss"], out["val/perplexity"] = mean, math.exp(min(mean, 80.0))
                continue
            out[f"val/{name}/loss@{seq_len}"] = mean
            out[f"val/{name}/ppl@{seq_len}"] = math.exp(min(mean, 80.0))
            out[f"val/{name}/bpb@{seq_len}"] = loss_sum / (math.log(2) * nbytes) if nbytes else math.nan
        for (name, seq_len), choice in self.choices.items():
            loglik = logliks[(name, seq_len)]
            for metric, value in choice.metrics(loglik).items():
                out[f"val/{name}/{metric}@{seq_len}"] = value
            if arrays is not None:
                choice.save(arrays / f"{name}@{seq_len}.npz", loglik)
        out["time/val"] = time.perf_counter() - t0
        return out
