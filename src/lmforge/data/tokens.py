"""`data.type = "tokens"`: pretraining windows over a pool of datatrove token shards.

Windows are `seq_len + 1` tokens at stride `seq_len`, so every token is a target once per epoch. Epoch e draws,
from a generator seeded by (data.seed, e), a token offset in [0, seq_len) where its windows begin and then a
permutation of those windows. Windows are numbered globally across epochs; a step takes the next
`batch_tokens / seq_len` of them and each rank its contiguous slice, so what a step trains on depends only on the
config, never on the world size. The resume state is (epoch, windows consumed in it).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.config.data import TokensDataConfig
from lmforge.data.batch import MicroBatch, StepLayout, Window, pack_windows, segments_from_doc_starts
from lmforge.data.shards import ShardError, ShardPool
from lmforge.data.sources import SourceMap
from lmforge.data.tokenizer import TokenizerInfo


def check_shards(pool: ShardPool, tokenizer: TokenizerInfo) -> None:
    """Every file's first document must end with the tokenizer's EOS: shards made with another tokenizer, or by a
    DocumentTokenizer without `eos_token`, fail here. Ids must also fit the token size of the vocabulary."""
    for f in pool.files:
        first_end = int(f.doc_ends[0])
        found = int(f.tokens[first_end - 1])
        if found != tokenizer.eos_id:
            raise ShardError(
                f"{f.path}: the first document ends with token id {found}, expected the tokenizer's EOS "
                f"{tokenizer.eos_id} ({tokenizer.eos_token!r}); were these shards made with another tokenizer, or "
                "without eos_token?"
            )
        if f.tokens.dtype.itemsize == 2 and tokenizer.size > 65536:
            raise ShardError(f"{f.path}: uint16 tokens cannot hold a vocabulary of {tokenizer.size} ids")


def check_token_ids(pool: ShardPool, tokens: np.ndarray, start: int, vocab_size: int) -> None:
    """Raise a ShardError naming the file and offset of the first id of `tokens` (the pool's tokens from offset
    `start` on) that is outside a vocabulary of `vocab_size` ids."""
    if tokens.size and tokens.max() >= vocab_size:
        bad = int(np.argmax(tokens >= vocab_size))
        f, at = pool.locate(start + bad)
        raise ShardError(f"{f.path}: token id {int(tokens[bad])} at offset {at} is outside the vocabulary "
                         f"({vocab_size} ids)")  # fmt: skip


class TokenData:
    """The window stream of one rank over a shard pool."""

    def __init__(self, cfg: TokensDataConfig, rank: int, world_size: int, tokenizer: TokenizerInfo) -> None:
        self.cfg = cfg
        self.layout = StepLayout.from_tokens(cfg.seq_len, cfg.batch_tokens, cfg.micro_batch_tokens, rank, world_size)
        self.pool = ShardPool([Path(p) for p in cfg.paths])
        self.sources = SourceMap.for_pool(self.pool, [Path(p) for p in cfg.paths])
        """Per-source token counts of the windows, when a folder is a mixture (None otherwise)."""
        self.vocab_size = tokenizer.size
        check_shards(self.pool, tokenizer)
        if self.pool.num_tokens < cfg.seq_len + 1:
            raise ShardError(
                f"data.paths hold {self.pool.num_tokens} tokens, fewer than one window ({cfg.seq_len + 1})"
            )
        self.windows_done = 0
        self._ends = [0]  # global window number where each epoch starts, grown as epochs are reached

    def check_budget(self, max_steps: int) -> None:
        """Fail now if the run needs more than data.max_epochs passes over the pool."""
        planned = max_steps * self.cfg.batch_tokens
        available = self.pool.num_tokens * self.cfg.max_epochs
        if planned > available:
            needed = planned / self.pool.num_tokens
            raise ShardError(
                f"max_steps x data.batch_tokens = {planned:,} tokens, but data.paths hold {self.pool.num_tokens:,} "
                f"tokens and data.max_epochs = {self.cfg.max_epochs}: the run needs {math.ceil(needed)} epochs "
                f"({needed:.2f}); raise data.max_epochs, add data or lower max_steps"
            )

    def _rng(self, epoch: int) -> tuple[np.random.Generator, int, int]:
        rng = np.random.default_rng([self.cfg.seed, epoch])
        offset = int(rng.integers(0, self.cfg.seq_len))
        return rng, offset, (self.pool.num_tokens - offset - 1) // self.cfg.seq_len

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one stream per process: the current and the next epoch
    def _order(self, epoch: int) -> tuple[int, np.ndarray]:
        rng, offset, count = self._rng(epoch)
        return offset, rng.permutation(count).astype(np.int32 if count < 2**31 else np.int64)

    def position(self, global_window: int) -> tuple[int, int]:
        """(epoch, index in epoch) of a global window number."""
        while self._ends[-1] <= global_window:
            self.epoch_start(len(self._ends))
        epoch = int(np.searchsorted(self._ends, global_window, side="right")) - 1
        return epoch, global_window - self._ends[epoch]

    def epoch_start(self, epoch: int) -> int:
        """The global number of the first window of `epoch`."""
        while len(self._ends) <= epoch:
            self._ends.append(self._ends[-1] + self._rng(len(self._ends) - 1)[2])
        return self._ends[epoch]

    def epoch_order(self, epoch: int) -> tuple[int, np.ndarray]:
        """The token offset where `epoch`'s windows begin, and the order the epoch visits them in: its i-th window
        is window order[i], starting at offset + order[i] * seq_len."""
        return self._order(epoch)

    def epoch_size(self, epoch: int) -> int:
        """Windows in epoch `epoch` (it varies by at most one with the epoch's offset)."""
        return self._rng(epoch)[2]

    def window_start(self, global_window: int) -> int:
        """The pool offset of the first token of the window with this global number."""
        epoch, index = self.position(global_window)
        if epoch >= self.cfg.max_epochs:
            raise ShardError(f"data.max_epochs = {self.cfg.max_epochs} reached at window {global_window}")
        offset, order = self._order(epoch)
        return offset + int(order[index]) * self.cfg.seq_len

    def window(self, global_window: int) -> Window:
        """The window with this global number."""
        start = self.window_start(global_window)
        tokens, doc_starts, loss = self.pool.read(start, self.cfg.seq_len + 1)
        check_token_ids(self.pool, tokens, start, self.vocab_size)
        seg_lens = (
            segments_from_doc_starts((doc_starts - start).tolist(), self.cfg.seq_len)
            if self.cfg.document_masking
            else [self.cfg.seq_len]
        )
        mask = loss[1:].astype(bool) if loss is not None else None
        # The window trains on its targets, pool positions start + 1 .. start + seq_len.
        counts = self.sources.count(start + 1, self.cfg.seq_len) if self.sources is not None else None
        return Window(tokens, seg_lens, mask, counts)

    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next step."""
        mine = self.layout.rank_windows(self.windows_done)
        self.windows_done += self.layout.windows_per_step
        return [pack_windows([self.window(i) for i in chunk]) for chunk in self.layout.split(mine)]

    def skip_steps(self, steps: int) -> None:
        """Move the stream past `steps` steps without reading them."""
        self.windows_done += steps * self.layout.windows_per_step

    def state_dict(self) -> dict[str, Any]:
        """(epoch, windows consumed in it), plus the global counter they come from."""
        epoch, index = self.position(self.windows_done)
        return {"epoch": epoch, "index": index, "windows": self.windows_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the pool must be the one the state was taken on."""
        self.windows_done = int(state["windows"])
        if self.position(self.windows_done) != (int(state["epoch"]), int(state["index"])):
            raise ShardError(
                f"data state (epoch {state['epoch']}, window {state['index']}) does not match the current pool of "
                f"{self.pool.num_tokens:,} tokens: data.paths, data.seq_len or data.seed changed since it was saved"
            )

    @property
    def epoch(self) -> float:
        """Passes over the pool so far, fractional."""
        epoch, index = self.position(self.windows_done)
        return epoch + index / self.epoch_size(epoch)
