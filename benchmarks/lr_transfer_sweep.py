"""Training the runs of the learning-rate transfer benchmark (`lr_transfer.py`): one run from scratch with lmforge's
`Trainer`, its held-out loss, and the lr grid search that extends a grid until its best lr is bracketed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lmforge.checkpoint.run_dir import prepare_output_dir
from lmforge.config import TokensDataConfig
from lmforge.config.checks import check_config
from lmforge.data.batch import MicroBatch
from lmforge.data.tokenizer import load_tokenizer
from lmforge.data.tokens import TokenData
from lmforge.parallel.process_group import DistContext
from lmforge.train.micro_batches import token_loss_sum
from lmforge.train.trainer import Trainer
from lr_transfer_config import RunKey, Settings

DIVERGENCE_NATS = 1.0
"""A run whose training loss exceeds its first step's loss by more than this is stopped as diverged."""


@dataclass
class Run:
    """The figures of one training run."""

    key: RunKey
    heldout_loss: float
    """Held-out loss after the last step trained (NaN if not finite)."""
    train_loss: float
    """Training loss of the last step trained."""
    steps: int
    """Steps trained (fewer than asked when the run diverged)."""
    diverged: bool
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(tokens trained, held-out loss) at each evaluation, from 0 tokens on (only for the Muon-vs-AdamW runs)."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {**asdict(self.key), "lr": 2.0**self.key.lr_exp, **{k: v for k, v in asdict(self).items() if k != "key"}}


def rank_loss(run: Run) -> float:
    """The loss that ranks learning rates: the held-out loss, a diverged or non-finite run last."""
    return math.inf if run.diverged or not math.isfinite(run.heldout_loss) else run.heldout_loss


def heldout_batches(settings: Settings, data_dir: Path) -> list[MicroBatch]:
    """A fixed set of held-out micro-batches (`eval_tokens` tokens of `data/demo/heldout` windows)."""
    cfg = TokensDataConfig(
        paths=[str(data_dir / "heldout")],
        seq_len=settings.seq_len,
        batch_tokens=settings.eval_tokens,
        micro_batch_tokens=settings.micro_batch_tokens,
        document_masking=True,
        seed=settings.seed,
    )
    return TokenData(cfg, 0, 1, load_tokenizer(str(data_dir / "tokenizer"))).next_step()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches: list[MicroBatch], device: torch.device) -> float:
    """Mean cross-entropy over every loss token of the held-out micro-batches."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for mb in batches:
        total += token_loss_sum(model, mb.to(device)).double()
        count += int(mb.loss_mask.sum())
    loss = float(total) / max(count, 1)
    return loss if math.isfinite(loss) else math.nan


class Runner:
    """Trains runs on demand and keeps their figures; identical runs are trained once."""

    def __init__(
        self, settings: Settings, data_dir: Path, ctx: DistContext, tmp: Path, log: Callable[[str], None]
    ) -> None:
        """`tmp` holds the run folders (config and metrics only: no checkpoints); `log` gets a line per run."""
        self.settings = settings
        self.data_dir = data_dir
        self.ctx = ctx
        self.tmp = tmp
        self.log = log
        self.heldout = heldout_batches(settings, data_dir)
        self.runs: dict[RunKey, Run] = {}

    def canonical(self, key: RunKey) -> RunKey:
        """The run that trains the same model: at the base shape CompleteP is the standard parameterization."""
        s = self.settings
        if key.scheme == "completep" and key.width == s.base_width and s.num_layers == s.base_layers:
            return replace(key, scheme="normal")
        return key

    def wants_curve(self, key: RunKey) -> bool:
        """Whether a run feeds the Muon-vs-AdamW comparison (held-out loss every `eval_every` steps)."""
        return key.scheme == "normal" and key.width == self.settings.muon_width

    def get(self, key: RunKey) -> Run:
        """The figures of a run, training it first if it has not been trained."""
        key = self.canonical(key)
        if key not in self.runs:
            self.runs[key] = self.train(key)
        return self.runs[key]

    def train(self, key: RunKey) -> Run:
        """Train one run from scratch and evaluate it."""
        s = self.settings
        t0 = time.perf_counter()
        config = s.train_config(key, self.data_dir, str(self.tmp / "run"))
        check_config(config, self.ctx.world_size)
        prepare_output_dir(config, overwrite=True)
        trainer = Trainer(config, self.ctx, console=False)
        curve_every = s.eval_every if self.wants_curve(key) else None
        curve: list[tuple[int, float]] = []
        first = train_loss = math.nan
        diverged = False
        step = 0
        try:
            if curve_every is not None:
                curve.append((0, heldout_loss(trainer.model, self.heldout, self.ctx.device)))
            while step < s.steps:
                metrics = trainer.train_step(trainer.data.next_step(), 0.0)
                step += 1
                train_loss = metrics["loss/mean"]
                first = train_loss if step == 1 else first
                diverged = not math.isfinite(train_loss) or train_loss > first + DIVERGENCE_NATS
                if curve_every is not None and (step % curve_every == 0 or step == s.steps) and not diverged:
                    curve.append((int(metrics["progress/num_tokens"]), self._eval(trainer)))
                if diverged:
                    break
            final = curve[-1][1] if curve and curve[-1][0] == step * s.batch_tokens else self._eval(trainer)
        finally:
            trainer.close()
        run = Run(key, final, train_loss, step, diverged, curve, time.perf_counter() - t0)
        base = key.scheme == "normal" and self.canonical(replace(key, scheme="completep")) == key
        shared = " (= completep)" if base else ""
        self.log(
            f"{key.optimizer:>5} {key.scheme:>9}{shared} d{key.width:<4} lr 2^{key.lr_exp:<3}: held-out "
            f"{run.heldout_loss:.4f}, train {train_loss:.4f}, {step} steps"
            f"{' [red]diverged[/]' if diverged else ''} ({run.seconds:.0f} s)"
        )
        return run

    def _eval(self, trainer: Trainer) -> float:
        return heldout_loss(trainer.model, self.heldout, self.ctx.device)

    def search(self, optimizer: str, scheme: str, width: int, exps: tuple[int, ...]) -> dict[int, Run]:
        """Runs at each lr exponent of the grid, extended one step at a time (at most `max_extend` per side) on the
        side where the best lr sits at the edge, so that a worse lr brackets it on both sides where possible."""
        tried = sorted(set(exps))
        runs = {e: self.get(RunKey(optimizer, scheme, width, e)) for e in tried}
        extended = {-1: 0, 1: 0}
        while True:
            best = min(runs, key=lambda e: (rank_loss(runs[e]), e))
            side = -1 if best == min(runs) else 1 if best == max(runs) else 0
            if side == 0 or extended[side] >= self.settings.max_extend or math.isinf(rank_loss(runs[best])):
                return dict(sorted(runs.items()))
            extended[side] += 1
            e = best + side
            runs[e] = self.get(RunKey(optimizer, scheme, width, e))
