"""Callbacks run in the one order `lmforge/train/callbacks/order.py` declares: `in_order` sorts any list into it,
and a trainer with every kind of callback calls them so, step after step."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmforge.config import TrainConfig
from lmforge.monitor import read_metrics
from lmforge.parallel.process_group import DistContext, init_distributed
from lmforge.train.callbacks.balancing import MoEBalancer
from lmforge.train.callbacks.base import Callback
from lmforge.train.callbacks.batch_hashes import BatchHashes
from lmforge.train.callbacks.checkpointing import Checkpointing
from lmforge.train.callbacks.eval_snapshots import EvalSnapshots
from lmforge.train.callbacks.mtp import MtpLoss
from lmforge.train.callbacks.order import EXTRA, ORDER, in_order, place
from lmforge.train.callbacks.reporting import Reporting
from lmforge.train.callbacks.source_shares import SourceShares
from lmforge.train.callbacks.spike_flags import SpikeFlags
from lmforge.train.callbacks.validation import Validation
from lmforge.train.trainer import Trainer
from tests.shards import random_docs, word_tokenizer, write_shard
from tests.unit.test_moe import tiny_glm


class Extra(Callback):
    """A callback of none of the built-in kinds, as a user passes one to the `Trainer`."""


def test_the_order_names_every_built_in_kind_once() -> None:
    kinds = [k for k in ORDER if isinstance(k, type)]
    assert kinds == [MoEBalancer, MtpLoss, SpikeFlags, Checkpointing, EvalSnapshots, SourceShares, BatchHashes,
                     Validation, Reporting]  # fmt: skip
    assert ORDER.count(EXTRA) == 1 and ORDER[-1] is Reporting  # reporting sees every metric the others add


def test_in_order_puts_each_kind_in_its_place_and_keeps_extra_ones_as_given() -> None:
    kinds = [k for k in ORDER if isinstance(k, type)]
    built = [object.__new__(k) for k in kinds]  # only their kind matters here
    first, second = Extra(), Extra()
    mixed = [*built, first, second]
    random.Random(0).shuffle(mixed)
    ordered = in_order(mixed)
    extra_at = ORDER.index(EXTRA)
    assert [type(cb) for cb in ordered] == [*kinds[:extra_at], Extra, Extra, *kinds[extra_at:]]
    assert [cb for cb in ordered if isinstance(cb, Extra)] == [cb for cb in mixed if isinstance(cb, Extra)]
    assert [place(cb) for cb in ordered] == sorted(place(cb) for cb in mixed)


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def _config(tmp: Path) -> TrainConfig:
    tok = word_tokenizer(tmp / "tok", size=100)
    write_shard(tmp / "held", "00000", random_docs(20, seed=5, vocab=100))
    return TrainConfig.model_validate({
        "max_steps": 2,
        "output_dir": str(tmp / "run"),
        "tokenizer": {"name": str(tok)},
        "model": {"arch": tiny_glm().model_dump(), "moe_balance": {"coeff": 0.01}},
        "data": {"type": "fake", "seq_len": 32, "batch_tokens": 128, "micro_batch_tokens": 64, "vocab_size": 100},
        "optim": {"lr": 1e-3},
        "ckpt": {"interval": 1},
        "eval_snapshots": {"interval": 1},
        "val": {"sets": [{"name": "held", "path": str(tmp / "held")}], "interval": 1, "micro_batch_tokens": 64},
    })  # fmt: skip


def _recorded(cb: Callback, calls: list[str]) -> Callable[[Trainer, dict[str, float]], None]:
    """`cb.after_optimizer_step`, noting the callback's kind in `calls` first."""
    step = cb.after_optimizer_step

    def run(trainer: Trainer, metrics: dict[str, float]) -> None:
        calls.append(type(cb).__name__)
        step(trainer, metrics)

    return run


def test_a_trainer_calls_its_callbacks_in_the_declared_order(tmp_path: Path, ctx: DistContext) -> None:
    calls: list[str] = []

    class Recorder(Extra):
        def after_optimizer_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
            calls.append("extra")

    trainer = Trainer(_config(tmp_path), ctx, callbacks=[Recorder()], console=False)
    kinds = [type(cb) for cb in trainer.callbacks]
    assert kinds == [MoEBalancer, SpikeFlags, Checkpointing, EvalSnapshots, Validation, Recorder, Reporting]
    for cb in trainer.callbacks:
        if not isinstance(cb, Recorder):
            cb.after_optimizer_step = _recorded(cb, calls)  # type: ignore[method-assign]
    trainer.train()
    per_step = ["MoEBalancer", "SpikeFlags", "Checkpointing", "EvalSnapshots", "Validation", "extra", "Reporting"]
    assert calls == per_step * 2
    # What the order is for: a checkpoint holds the spike history of its own step, and the logged step carries the
    # metrics every callback before reporting added.
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "trainer.json").read_text())
    assert len(saved["callbacks"]["spike_flags"]["loss"]) == 2
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert {"time/save_ckpt", "time/save_snapshot", "loss/spike", "max_vio/mean"} <= last.keys()
    assert any(key.startswith("val/held/") for key in last)
