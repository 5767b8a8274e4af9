"""The documents of a run's steps, from its run directory: replayed (`lmforge.data.replay`), described as plain data
(what `lmforge replay` prints and writes as JSON, and `lmforge report` shows for spikes) and optionally scored with
a checkpoint's weights (`lmforge.eval.document_loss`)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.checkpoint.layout import (
    CHECKPOINTS,
    data_position_before,
    list_checkpoints,
    read_trainer_state,
    step_name,
)
from lmforge.config.train import TrainConfig
from lmforge.data.base import StepData
from lmforge.data.batch import MicroBatch
from lmforge.data.replay import (
    ReplayedBatch,
    ReplayError,
    document_source,
    document_windows,
    replay_next_step,
    seek,
)
from lmforge.data.sft import SFTData
from lmforge.data.stream import build_step_data
from lmforge.data.tokenizer import TokenizerInfo, load_tokenizer
from lmforge.data.tokens import TokenData
from lmforge.eval.document_loss import score_documents
from lmforge.eval.worker import read_run_config
from lmforge.hf.folder import load_pretrained
from lmforge.model.llama import CausalLM
from lmforge.monitor.jsonl import read_metrics


class RunSteps:
    """A run's data, replayed step by step in one process, and the checkpoints that score it."""

    def __init__(self, run_dir: Path) -> None:
        """Read the run's config.toml and tokenizer (a `ConfigError` or `TokenizerError` names what is wrong)."""
        self.run_dir = run_dir
        self.config: TrainConfig = read_run_config(run_dir)
        name = self.config.tokenizer.name
        self.tokenizer: TokenizerInfo | None = load_tokenizer(name) if name else None
        self._stream: StepData | None = None
        self._at = (-1, -1)  # (step of the position the stream started from, the step it is before)
        self._models: dict[int, CausalLM] = {}

    def _stream_at(self, step: int) -> StepData:
        """The one-process stream at the start of `step`, moved on from where it is when it can be; the caller
        consumes exactly that step."""
        if not 1 <= step <= self.config.max_steps:
            raise ReplayError(f"step {step}: the run's steps are 1..{self.config.max_steps}")
        anchor, position = data_position_before(self.run_dir, step)
        if self._stream is None or self._at[0] != anchor or self._at[1] > step:
            self._stream = build_step_data(self.config.data, 0, 1, self.tokenizer)
            seek(self._stream, position, step - 1 - anchor)
        else:
            seek(self._stream, None, step - self._at[1])
        self._at = (anchor, step + 1)
        return self._stream

    def replay(self, step: int) -> list[ReplayedBatch]:
        """The micro-batches of `step` with their documents."""
        return replay_next_step(self._stream_at(step))

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """The micro-batches of `step` in global order, as the trainer received them."""
        return self._stream_at(step).next_step()

    def last_step(self) -> int:
        """The last step the run logged (its max_steps when metrics.jsonl has none yet)."""
        path = self.run_dir / "metrics.jsonl"
        steps = [int(r["step"]) for r in read_metrics(path) if "loss/mean" in r] if path.is_file() else []
        return max(steps, default=self.config.max_steps)

    def document_steps(self, document: str) -> list[dict[str, Any]]:
        """Every step, up to the last one logged, that trained on `document`: `[SOURCE:]FILE:INDEX` for the INDEX-th
        document of a token shard (SOURCE, a mixture source, is checked against the document's), `FILE:LINE`
        (JSONL) or `FILE:ROW` (other formats) for an SFT row. Each entry has the step, the micro-batch and, for
        token data, the window and epoch."""
        file, _, number = document.rpartition(":")
        if not file or not number.isdigit():
            raise ReplayError(f"--document {document}: expected FILE:INDEX (or FILE:LINE for an SFT row)")
        source = None
        if ":" in file and not Path(file).exists():
            source, _, file = file.partition(":")
        last = self.last_step()
        probe = build_step_data(self.config.data, 0, 1, self.tokenizer)
        if isinstance(probe, TokenData):
            found = document_source(probe, file, int(number))
            if source is not None and source != found:
                raise ReplayError(f"--document {document}: document {number} of {file} comes from source {found!r}, "
                                  f"not {source!r}")  # fmt: skip
            return self._window_steps(probe, file, int(number), last)
        if isinstance(probe, SFTData):
            sample = probe.samples.find(file, int(number))
            if sample is None:
                raise ReplayError(
                    f"--document {document}: no sample of data.paths was read from {file} at line or row {number} "
                    "(rows without loss tokens and dropped ones are not samples)"
                )
            out = []
            for step in range(1, last + 1):
                bins = self._stream_at(step).next_bins()  # type: ignore[attr-defined]
                out += [{"step": step, "micro_batch": i} for i, b in enumerate(bins) if sample in b]
            return out
        raise ReplayError("data.type = 'fake' draws no documents: there is nothing to replay")

    def _window_steps(self, data: TokenData, file: str, index: int, last: int) -> list[dict[str, Any]]:
        # Where the stream stood after each checkpoint (and at the start): window w_k was the first of step k + 1.
        root = self.run_dir / CHECKPOINTS
        states = {k: read_trainer_state(root / step_name(k)) for k in list_checkpoints(root)}
        anchors = [(0, 0)] + [(k, int(state["data"]["windows"])) for k, state in states.items() if "data" in state]
        layout = data.layout
        end = max(w + (last - k) * layout.windows_per_step for k, w in anchors if k <= last)
        out = []
        for g in document_windows(data, file, index, end):
            k, w = max((a for a in anchors if a[1] <= g and a[0] <= last), key=lambda a: a[0])
            step = k + (g - w) // layout.windows_per_step + 1
            if step <= last:
                first = w + (step - k - 1) * layout.windows_per_step
                out.append({"step": step, "micro_batch": (g - first) // layout.windows_per_micro_batch, "window": g,
                            "epoch": data.position(g)[0]})  # fmt: skip
        return out

    def scoring_checkpoint(self, step: int, chosen: int | None = None) -> int:
        """The checkpoint that scores `step`: `chosen`, or the newest complete one at or before step - 1."""
        root = self.run_dir / CHECKPOINTS
        steps = list_checkpoints(root)
        have = ", ".join(map(str, steps)) or "none"
        if chosen is None:
            earlier = [s for s in steps if s <= step - 1]
            if not earlier:
                raise ReplayError(f"{root} has no complete checkpoint at or before step {step - 1} to score step "
                                  f"{step} with (complete checkpoints: {have})")  # fmt: skip
            return earlier[-1]
        if chosen not in steps:
            raise ReplayError(f"no complete checkpoint {root / step_name(chosen)} (complete checkpoints: {have})")
        return chosen

    def score(self, batches: list[ReplayedBatch], described: list[dict[str, Any]], checkpoint: int) -> dict[str, Any]:
        """Score `batches` with `checkpoint`'s weights: adds `loss_sum` and `loss_mean` to each document of
        `described` (their `describe_batch`) and returns the checkpoint and the documents' loss sum and targets."""
        if checkpoint not in self._models:
            path = self.run_dir / CHECKPOINTS / step_name(checkpoint)
            self._models[checkpoint], _ = load_pretrained(path, attn=self.config.model.attn)
        losses = score_documents(self._models[checkpoint], batches, torch.device("cpu"))
        for doc, scored in zip(documents_of(described), losses, strict=True):
            doc["loss_sum"], doc["loss_mean"] = scored.loss_sum, scored.loss_mean
        total, tokens = sum(d.loss_sum for d in losses), sum(d.piece.loss_tokens for d in losses)
        return {"checkpoint": checkpoint, "loss_sum": total, "loss_tokens": tokens,
                "loss_mean": total / tokens if tokens else float("nan")}  # fmt: skip


def documents_of(described: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every document of described micro-batches, in order."""
    return [d for mb in described for row in mb["rows"] for d in row["documents"]]


def top_documents(described: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The `k` scored documents of highest summed loss, each with its micro-batch index."""
    found = [{"micro_batch": mb["index"], **d} for mb in described for row in mb["rows"] for d in row["documents"]]
    return sorted(found, key=lambda d: -d["loss_sum"])[:k]


def describe_batch(batch: ReplayedBatch, tokenizer: TokenizerInfo, chars: int) -> dict[str, Any]:
    """A replayed micro-batch as plain data: its index, hash, loss tokens and rows, each row's documents with where
    they come from, their span, cut flags, loss tokens and text (the first `chars` characters; 0: all)."""
    rows = []
    for row in batch.rows:
        documents = []
        for p in row.pieces:
            segments = text_runs(p.token_ids, p.loss, tokenizer, chars)
            documents.append({
                "where": p.where,
                "source": p.source,
                "span": [p.start, p.start + len(p.token_ids)],
                "tokens": len(p.token_ids),
                "cut_before": p.cut_before,
                "cut_after": p.cut_after,
                "loss_tokens": p.loss_tokens,
                "text": "".join(s["text"] for s in segments),
                "segments": segments,
            })  # fmt: skip
        rows.append({"row": row.label, "documents": documents})
    return {"index": batch.index, "hash": batch.hash, "loss_tokens": int(batch.batch.loss_mask.sum()), "rows": rows}


def text_runs(ids: np.ndarray, loss: np.ndarray, tokenizer: TokenizerInfo, chars: int) -> list[dict[str, Any]]:
    """The text of `ids` (its first `chars` characters; 0: all) in runs of tokens that are, or are not, loss
    targets, so an SFT row shows what it trains on."""
    cuts = [0, *(np.flatnonzero(np.diff(loss.astype(np.int8))) + 1).tolist(), len(ids)]
    runs: list[dict[str, Any]] = []
    left = chars or None
    for a, b in itertools.pairwise(cuts):
        if b == a:
            continue
        text = tokenizer.tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        if left is not None:
            text, left = (text, left - len(text)) if len(text) < left else (text[:left] + "…", 0)
        runs.append({"loss": bool(loss[a]), "text": text})
        if left == 0:
            break
    return runs
