"""The background data worker: same stream, right resume state, no compute threads of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmforge.config import FakeDataConfig
from lmforge.data.prefetch import Prefetcher
from lmforge.data.stream import build_step_data
from tests.shards import random_docs, word_tokenizer, write_shard

CFG = FakeDataConfig(seq_len=64, batch_tokens=512, micro_batch_tokens=128, pattern="counting")


def test_prefetched_stream_equals_direct_stream() -> None:
    direct = build_step_data(CFG, 0, 1)
    ahead = Prefetcher(build_step_data(CFG, 0, 1), depth=3)
    try:
        for step in range(4):
            a, b = direct.next_step(), ahead.next_step()
            assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b, strict=True))
            # the state is that of the steps handed out, not of the ones prepared ahead
            assert ahead.state_dict() == direct.state_dict() == {"windows": 8 * (step + 1)}
    finally:
        ahead.close()


def test_worker_errors_reach_the_trainer() -> None:
    class Broken:
        epoch = 0.0

        def next_step(self) -> list:
            raise OSError("shard vanished")

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    ahead = Prefetcher(Broken())
    with pytest.raises(OSError, match="shard vanished"):
        ahead.next_step()
    ahead.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("kind", ["fake", "tokens"])
def test_building_micro_batches_starts_no_compute_threads(kind: str, tmp_path: Path) -> None:
    # A torch compute op in the worker thread would give it an OpenMP team of its own (one more OS thread here),
    # which slows the trainer's compute threads; the data path must stay in numpy.
    script = textwrap.dedent(
        """
        import os, threading, torch
        from lmforge.config import FakeDataConfig, TokensDataConfig
        from lmforge.data.stream import build_step_data
        from lmforge.data.tokenizer import load_tokenizer
        torch.set_num_threads(2)
        a = torch.randn(256, 256)
        (a @ a).sum()
        sizes = dict(seq_len=64, batch_tokens=512, micro_batch_tokens=128)
        if KIND == "fake":
            data = build_step_data(FakeDataConfig(**sizes), 0, 1)
        else:
            cfg = TokensDataConfig(paths=[SHARDS], max_epochs=100, **sizes)
            data = build_step_data(cfg, 0, 1, load_tokenizer(TOKENIZER))
        before = len(os.listdir("/proc/self/task"))
        done, release = threading.Event(), threading.Event()
        def work():
            data.next_step()
            data.next_step()
            done.set()
            release.wait()
        t = threading.Thread(target=work)
        t.start()
        done.wait()
        print(len(os.listdir("/proc/self/task")) - before)
        release.set()
        t.join()
        """
    )
    write_shard(tmp_path / "shards", "00000", random_docs(200, seed=0))
    word_tokenizer(tmp_path / "tok")
    header = f"KIND = {kind!r}\nSHARDS = {str(tmp_path / 'shards')!r}\nTOKENIZER = {str(tmp_path / 'tok')!r}\n"
    out = subprocess.run(
        [sys.executable, "-c", header + script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # the worker thread itself, nothing more
