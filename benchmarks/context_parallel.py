"""Context parallelism: per-rank activation memory and step time against the row length, for cp = 1, 2 and 4.

For each row length T and CP degree, the script starts `cp` processes (gloo on the CPU, one compute thread each;
NCCL with `--device cuda`), builds the same Llama on each (d256 x 4 layers, 8 heads, 4 KV heads by default, fp32),
and runs forward + backward on one packed row of T random tokens cut into documents (mean 512 tokens, so they
cross chunk and rank boundaries), split over the ranks as training splits it (`lmforge.parallel.context`). Per rank
it reports:

- `activations`: bytes of the tensors autograd saves for backward (each storage counted once, parameters left
  out): the activation memory a step holds at its peak, which context parallelism divides;
- `gathered`: bytes of keys and values the rank receives from the others in forward (the all-gather; backward sends
  as many gradient bytes back);
- `step`: median seconds of forward + backward over `--repeats` timed passes after one warmup pass.

Expected: activations per rank fall about 1/cp, except what grows with the whole row: the gathered keys and values
(2 x T x KV heads x head dim per layer) and, with the CPU's SDPA kernel, the [T / cp, T] mask and attention scores.
On 2 cores, 4 ranks share the cores, so their step times are not those of 4 devices.

    .venv/bin/python benchmarks/context_parallel.py [--seq-lens 1024 2048 4096] [--cps 1 2 4] [--repeats N]
                                                    [--device cpu|cuda] [--json PATH]
    .venv/bin/python benchmarks/context_parallel.py --smoke     # tiny model, T in (128, 256), cp in (1, 2)

The script exits 0 when every configuration ran (it is a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from common import make_console, result_table, write_json
from lmforge.config.arch import LlamaArch
from lmforge.data.batch import MicroBatch
from lmforge.model import build_model
from lmforge.model.init import init_weights

MEAN_DOC = 512
"""Mean document length of the row."""


def _arch(smoke: bool) -> LlamaArch:
    if smoke:
        return LlamaArch(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    return LlamaArch(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, max_position_embeddings=65536)  # fmt: skip


def _row(total: int, vocab: int) -> MicroBatch:
    """One packed row of random tokens in documents of random lengths (mean `MEAN_DOC`)."""
    rng = np.random.default_rng(0)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(int(min(rng.integers(1, 2 * MEAN_DOC), total - sum(lens))))
    tokens = torch.from_numpy(rng.integers(1, vocab, size=total + 1))
    positions = torch.cat([torch.arange(n) for n in lens])
    return MicroBatch(
        input_ids=tokens[:-1][None],
        target_ids=tokens[1:][None],
        position_ids=positions[None],
        loss_mask=torch.ones(1, total, dtype=torch.bool),
        doc_lens=torch.tensor(lens, dtype=torch.int32),
    )


def _rank(rank: int, cp: int, port: int, total: int, smoke: bool, repeats: int, device_type: str,
          out: str) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cp))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import lmforge.parallel.context as context_parallel
    from lmforge.model.loss import IGNORE_INDEX
    from lmforge.parallel.context import ContextShard, apply_context_parallel, shard_micro_batch

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        vocab = 1024
        model = build_model(_arch(smoke), vocab, "sdpa", device)
        init_weights(model, 0.02, seed=0)
        shard = ContextShard(dist.new_group(list(range(cp))), rank, cp, "flex" if device.type == "cuda" else "sdpa")
        if cp > 1:
            apply_context_parallel(model, shard)
        mb = shard_micro_batch(_row(total, vocab), shard).to(device)
        gathered = [0]
        plain_gather = context_parallel.gather_row

        def counting_gather(x: torch.Tensor, s: ContextShard) -> torch.Tensor:
            gathered[0] += x.numel() * x.element_size() * (s.size - 1)  # received from the other ranks
            return plain_gather(x, s)

        context_parallel.gather_row = counting_gather  # type: ignore[assignment]
        saved: dict[int, int] = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:  # parameters are saved too, but are no activations
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        def step() -> None:
            targets = mb.target_ids.masked_fill(~mb.loss_mask, IGNORE_INDEX)
            loss = model(mb.input_ids, mb.position_ids, mb.doc_lens, targets=targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()  # warmup; also measures what a step saves
        per_step_gathered = gathered[0]
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        result = {"activations": sum(saved.values()), "gathered": per_step_gathered, "step": statistics.median(times)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(total: int, cp: int, smoke: bool, repeats: int, device: str) -> dict[str, Any]:
    """Per-rank figures of one configuration: the max over ranks of each."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(cp, _free_port(), total, smoke, repeats, device, out), nprocs=cp,
                           start_method="spawn")  # fmt: skip
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
    return {key: max(r[key] for r in ranks) for key in ("activations", "gathered", "step")}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print (and optionally write) its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model, T in (128, 256), cp in (1, 2)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    seq_lens, cps, repeats = args.seq_lens, args.cps, args.repeats
    if args.smoke:
        seq_lens, cps, repeats = [128, 256], [1, 2], 1
    rows = []
    for total in seq_lens:
        for cp in cps:
            figures = measure(total, cp, args.smoke, repeats, args.device)
            rows.append({"seq_len": total, "cp": cp, **figures})
    console = make_console()
    table = result_table(f"Context parallelism on {args.device}: per-rank figures (max over ranks)",
                         ["T", "cp", "activations MiB", "vs cp=1", "gathered MiB", "step s"])  # fmt: skip
    for row in rows:
        base = next(r for r in rows if r["seq_len"] == row["seq_len"] and r["cp"] == min(cps))
        table.add_row(str(row["seq_len"]), str(row["cp"]), f"{row['activations'] / 2**20:.1f}",
                      f"{row['activations'] / base['activations']:.2f}x", f"{row['gathered'] / 2**20:.2f}",
                      f"{row['step']:.3f}")  # fmt: skip
    console.print(table)
    write_json(args.json, {"device": args.device, "smoke": args.smoke, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
