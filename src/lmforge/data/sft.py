"""`data.type = "sft"`: chat and prompt/completion samples with loss masks, packed into micro-batches.

Rows come from local files (`data/records.py`) in one of two layouts:
- `messages`: a list of `{role, content}` turns, rendered with the tokenizer's chat template (`data/chat.py`);
- `prompt` and `completion`: each a string or a list of turns. Two strings are plain text (the prompt a `user`
  turn, the completion an `assistant` turn ended with EOS); otherwise both become turns of one conversation.

Every sample is tokenized when the run starts, so a bad row fails before the first step, naming its file and row.
The stream: epoch e visits every sample once in a permutation drawn from (data.seed, e); samples are packed in
stream order (`data/packing.py`) into micro-batches of `micro_batch_tokens` positions; a step takes the next
batch_tokens / micro_batch_tokens micro-batches and rank r trains on the r-th contiguous share of them. The
resume state is the stream position (epoch, samples consumed in it) after the step, so the global stream does
not depend on the number of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.config.data import SFTDataConfig
from lmforge.data.batch import MicroBatch
from lmforge.data.chat import ChatError, ChatTemplate, Tokens, encode_chat, encode_prompt_completion
from lmforge.data.packing import fill_bins, pack_samples
from lmforge.data.records import Record, RecordError, read_records
from lmforge.data.tokenizer import TokenizerInfo

SHOWN_SKIPS = 3
"""Skipped rows named in the startup message (the rest are counted)."""


class SFTDataError(ValueError):
    """SFT data that cannot be used; the message names the file and row."""


@dataclass
class SampleStats:
    """What loading a set of samples kept, cut and left out."""

    rows: int = 0
    """Rows read."""
    overlong: int = 0
    """Samples longer than seq_len + 1 tokens (truncated or dropped, per data.overlong)."""
    dropped: int = 0
    """Overlong samples left out (data.overlong = "drop")."""
    no_loss: int = 0
    """Samples left out because none of their targets counts toward the loss."""
    skipped_at: list[str] = field(default_factory=list)
    """Where the first few samples without loss tokens are."""


@dataclass(frozen=True)
class SampleSet:
    """Tokenized samples, stored flat: sample i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray
    """int32 token ids of all samples."""
    loss: np.ndarray
    """bool per token: a loss target."""
    offsets: np.ndarray
    """int64 [n + 1] start of every sample, then the total."""
    stats: SampleStats
    """Counts from loading."""
    files: tuple[str, ...] = ()
    """The files the samples came from, in reading order."""
    origin: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    """int64 [n, 3] per sample: index into `files`, row in that file, and JSONL line number (-1 for other
    formats)."""
    truncated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """bool [n]: the sample was cut to seq_len + 1 tokens (data.overlong = "truncate")."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def positions(self) -> np.ndarray:
        """Positions (tokens - 1) of every sample: the room it takes in a micro-batch."""
        return np.diff(self.offsets) - 1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss) of sample i."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.loss[lo:hi]

    def where(self, i: int) -> str:
        """Where sample i was read: `FILE line N` for JSONL, `FILE row N` otherwise."""
        file, row, line = (int(v) for v in self.origin[i])
        return f"{self.files[file]} line {line}" if line >= 0 else f"{self.files[file]} row {row}"

    def find(self, file: str, number: int) -> int | None:
        """The sample read from `file` at JSONL line `number` (or row `number` for other formats), if one was."""
        wanted = Path(file).resolve()
        files = [i for i, f in enumerate(self.files) if Path(f).resolve() == wanted]
        if not files:
            return None
        line_or_row = np.where(self.origin[:, 2] >= 0, self.origin[:, 2], self.origin[:, 1])
        hits = np.flatnonzero((self.origin[:, 0] == files[0]) & (line_or_row == number))
        return int(hits[0]) if len(hits) else None

    def micro_batch(self, indices: Sequence[int], capacity: int) -> MicroBatch:
        """Samples `indices` packed into one micro-batch of `capacity` positions."""
        return pack_samples([self.sample(int(i)) for i in indices], capacity)


def _turns(value: Any, default_role: str, rec: Record, name: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    return _checked_messages(value, rec, name)


def _checked_messages(value: Any, rec: Record, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise SFTDataError(f"{rec.where()}: `{name}` must be a non-empty list of {{role, content}} turns")
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise SFTDataError(f"{rec.where()}: `{name}[{i}]` must be an object with a string `role`")
        if not isinstance(turn.get("content"), str) and not (turn.get("content") is None and turn.get("tool_calls")):
            raise SFTDataError(f"{rec.where()}: `{name}[{i}]` ({turn['role']}) has no string `content`")
    return value


def record_tokens(rec: Record, tokenizer: TokenizerInfo, template: ChatTemplate | None, roles: set[str]) -> Tokens:
    """One row as tokens with its loss mask (see the module docstring for the layouts)."""
    row = rec.data
    if "messages" in row:
        messages = _checked_messages(row["messages"], rec, "messages")
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return encode_prompt_completion(tokenizer, prompt, completion, roles)
        messages = [*_turns(prompt, "user", rec, "prompt"), *_turns(completion, "assistant", rec, "completion")]
    else:
        raise SFTDataError(
            f"{rec.where()}: a row needs `messages`, or `prompt` and `completion`; it has {sorted(row) or 'no fields'}"
        )
    if template is None:
        template = ChatTemplate.of(tokenizer)
    return encode_chat(tokenizer, template, messages, roles)


def load_samples(paths: Sequence[str], tokenizer: TokenizerInfo, cfg: SFTDataConfig) -> SampleSet:
    """Read and tokenize every row of `paths`; errors name the file and row, empty results are errors."""
    roles = set(cfg.loss_mask)
    template = ChatTemplate(tokenizer.chat_template, tokenizer) if tokenizer.chat_template else None
    limit = cfg.seq_len + 1
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    files: dict[str, int] = {}
    origin: list[tuple[int, int, int]] = []
    truncated: list[bool] = []
    stats = SampleStats()
    try:
        for rec in read_records(paths):
            stats.rows += 1
            try:
                tokens = record_tokens(rec, tokenizer, template, roles)
            except ChatError as e:
                raise SFTDataError(f"{rec.where()}: {e}") from None
            sample_ids, loss = tokens.ids, tokens.loss
            cut = len(sample_ids) > limit
            if cut:
                stats.overlong += 1
                if cfg.overlong == "drop":
                    stats.dropped += 1
                    continue
                sample_ids, loss = sample_ids[:limit], loss[:limit]
            if not loss[1:].any():  # the first token is never predicted
                stats.no_loss += 1
                if len(stats.skipped_at) < SHOWN_SKIPS:
                    stats.skipped_at.append(rec.where())
                continue
            ids.append(sample_ids)
            masks.append(loss)
            origin.append((files.setdefault(rec.source, len(files)), rec.row, -1 if rec.line is None else rec.line))
            truncated.append(cut)
    except RecordError as e:
        raise SFTDataError(str(e)) from None
    where = ", ".join(str(p) for p in paths)
    if stats.rows == 0:
        raise SFTDataError(f"{where}: no rows")
    if not ids:
        raise SFTDataError(
            f"{where}: none of the {stats.rows} rows has a token that counts toward the loss "
            f"(data.loss_mask = {sorted(roles)}, {stats.dropped} overlong rows dropped)"
        )
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in ids])
    return SampleSet(np.concatenate(ids), np.concatenate(masks), offsets, stats, tuple(files),
                     np.asarray(origin, dtype=np.int64), np.asarray(truncated, dtype=bool))  # fmt: skip


def describe(stats: SampleStats, kept: int) -> str:
    """One line on what loading kept and left out, naming the first rows without loss tokens."""
    text = f"{kept:,} samples from {stats.rows:,} rows"
    if stats.overlong:
        text += f"; {stats.overlong:,} overlong ({stats.dropped:,} dropped, the rest truncated)"
    if stats.no_loss:
        text += f"; {stats.no_loss:,} without loss tokens skipped (first at {', '.join(stats.skipped_at)})"
    return text


class SFTData:
    """The packed sample stream of one rank."""

    def __init__(self, cfg: SFTDataConfig, rank: int, world_size: int, tokenizer: TokenizerInfo) -> None:
        """Load and tokenize `cfg.paths` (every rank reads them; a rank keeps only its micro-batches)."""
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.samples = load_samples(cfg.paths, tokenizer, cfg)
        self.capacity = cfg.micro_batch_tokens
        self.per_step = cfg.batch_tokens // cfg.micro_batch_tokens
        self.epoch_, self.index = 0, 0
        self._positions = self.samples.positions

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one stream per process: the current and the next epoch
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.samples))

    def _stream(self, epoch: int, index: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, index, sample) from a position to the end of the last allowed epoch."""
        while epoch < self.cfg.max_epochs:
            order = self._order(epoch)
            for i in range(index, len(order)):
                yield epoch, i, int(order[i])
            epoch, index = epoch + 1, 0

    def _plan(self, count: int | None) -> tuple[list[list[int]], tuple[int, int]]:
        """The next `count` micro-batches (sample ids) from the current position, and the position after them;
        `count=None` packs the rest of the stream."""
        seen: list[tuple[int, int, int]] = []

        def lengths() -> Iterator[int]:
            for item in self._stream(self.epoch_, self.index):
                seen.append(item)  # fill_bins reads one sample past the last micro-batch: it opens the next one
                yield int(self._positions[item[2]])

        bins = fill_bins(lengths(), self.capacity, count)
        used = sum(len(b) for b in bins)
        after = seen[used][:2] if used < len(seen) else (self.cfg.max_epochs, 0)
        return [[seen[i][2] for i in b] for b in bins], after

    def steps_left(self) -> int:
        """Full steps the stream still holds up to data.max_epochs."""
        bins, _ = self._plan(None)
        return len(bins) // self.per_step

    def check_budget(self, max_steps: int, step: int) -> None:
        """Fail now if steps step+1..max_steps need more than data.max_epochs passes over the samples."""
        left = self.steps_left()
        if max_steps - step > left:
            raise SFTDataError(
                f"max_steps = {max_steps} needs {max_steps - step} more steps, but {len(self.samples):,} samples "
                f"packed into steps of data.batch_tokens = {self.cfg.batch_tokens:,} give {left} more over "
                f"data.max_epochs = {self.cfg.max_epochs}; set max_steps to at most {step + left} or raise "
                "data.max_epochs"
            )

    def next_bins(self) -> list[list[int]]:
        """The sample ids of every micro-batch of the next step (all ranks', in order), moving the stream past it."""
        bins, after = self._plan(self.per_step)
        if len(bins) < self.per_step:
            raise SFTDataError(f"data.max_epochs = {self.cfg.max_epochs} reached: the samples ran out mid-step")
        self.epoch_, self.index = after
        return bins

    def skip_steps(self, steps: int) -> None:
        """Move the stream past `steps` steps (packing them, without building their micro-batches)."""
        for _ in range(steps):
            self.next_bins()

    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next step."""
        share = self.per_step // self.world_size
        mine = self.next_bins()[self.rank * share : (self.rank + 1) * share]
        return [self.samples.micro_batch(b, self.capacity) for b in mine]

    def state_dict(self) -> dict[str, Any]:
        """The stream position after the last step handed out, and the number of samples it indexes."""
        return {"epoch": self.epoch_, "index": self.index, "samples": len(self.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the samples must be the ones it was taken on."""
        if int(state["samples"]) != len(self.samples):
            raise SFTDataError(
                f"data state was saved over {state['samples']:,} samples, but data.paths now give "
                f"{len(self.samples):,}: the data, data.seq_len, data.overlong or data.loss_mask changed since"
            )
        self.epoch_, self.index = int(state["epoch"]), int(state["index"])

    @property
    def epoch(self) -> float:
        """Passes over the samples so far, fractional."""
        return self.epoch_ + self.index / len(self.samples)
