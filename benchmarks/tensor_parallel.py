"""Tensor parallelism: per-rank memory and collective traffic of one training step at tp = 1, 2 and 4.

For each tp, the script starts tp processes (gloo on the CPU, one compute thread each; NCCL with `--device cuda`,
one GPU per rank) that form one TP group and build the same Llama the way training does (`build_model` on the meta
device, `parallelize` with the `DistContext` of `init_distributed(tp=...)`, `init_weights(std 0.02, seed 0)`;
fp32): d1024 x 4 layers, 16 heads, 8 KV heads, MLP 2816, vocabulary 8192, wider than the tests' models. Every
configuration trains on the same packed row of `seq_len` (1024) random tokens in documents of mean length 256
(a TP group's ranks all take the same row), with AdamW. A step is forward + backward (lmforge's loss over the row)
and the optimizer step. Per configuration, the maximum over its ranks of:

- `params` / `grads` / `optimizer`: bytes of this rank's parameter shards, their gradients and AdamW's state
  (local shards; with tp = 1 a single process holds everything);
- `activations`: bytes of the tensors autograd saves for backward (each storage once, weights left out), which
  sequence parallelism and the split heads and MLP divide by about tp;
- `all-gather`, `reduce-scatter`, `all-reduce`: bytes a rank sends per step in each kind of collective on its TP
  group (ring algorithm: (n - 1) / n of each buffer, twice for an all-reduce; counted on the real process group by
  `lmforge.plan.collectives`, over one untimed step);
- `step`: median seconds of `--repeats` timed steps after `--warmup` untimed ones, and tokens/s of the group.

Expected: params, grads and optimizer state fall as 1 / tp (the norms, which every rank holds whole, are a few KiB);
activations fall by somewhat less (the attention scores and each rank's share of the gathered tokens remain);
each block adds two all-gathers and two reduce-scatters of [tokens, hidden] in forward and as many in backward.
On 2 cores, 4 ranks share the cores, so their step times are not those of 4 devices: the CPU gives the memory and
traffic figures, a GPU node (`--device cuda`) the times.

`--peers` instead compares lmforge's TP with torchtitan's on one TP group of 2 processes: `benchmarks/peers.py
--procs 2 --tp 2 --peers torchtitan` (its settings and rules: same model, weights, tokens, threads and allocator
for both, tokens/s and peak memory per side); extra arguments after `--peers` go to it.

    .venv/bin/python benchmarks/tensor_parallel.py [--tps 1 2 4] [--seq-len T] [--repeats N] [--warmup N]
                                                   [--device cpu|cuda] [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/tensor_parallel.py --smoke     # tiny model, tp in (1, 2) (~30 s)
    .venv/bin/python benchmarks/tensor_parallel.py --peers [peers.py flags]

The script exits 0 when every configuration ran (it is a benchmark, not a test).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

import common
from context_parallel import _free_port
from cpu_load import own_cpu_s, settle
from expert_parallel import _local_bytes

COLLECTIVE_TIMEOUT_S = 300.0
"""Seconds a rank waits in a collective for the others (4 ranks on 2 cores take a while per step)."""
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collective kinds a TP step runs."""


@dataclass(frozen=True)
class Settings(common.ModelSettings):
    """The model, the row and the protocol; `seq_len` is the group's tokens per step (one packed row)."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 4
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    vocab_size: int = 8192
    seq_len: int = 1024
    mean_doc_len: float = 256.0
    warmup: int = 1
    """Untimed steps first (the first also measures the memory figures, the second the collectives)."""
    repeats: int = 3
    """Timed steps; the median is reported."""
    timeout: float = 1200.0
    """Seconds a configuration may run before its processes are killed."""


SMOKE = common.tiny(Settings, num_key_value_heads=2, vocab_size=512, seq_len=128, mean_doc_len=32.0, timeout=240.0)
"""d64 x 2, 128 tokens: a check that the script runs, in seconds."""


def _row(s: Settings) -> dict[str, torch.Tensor]:
    """The packed row every configuration trains on."""
    from expert_parallel import _row as expert_row

    return expert_row(s, 0)  # type: ignore[arg-type]


def run_rank(rank: int, world: int, port: int, s: Settings, device_type: str) -> dict[str, Any]:
    """One rank of one configuration (in a spawned process): build, measure memory and traffic, time steps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from lmforge.config.model import ModelConfig
    from lmforge.model import build_model
    from lmforge.model.init import init_weights
    from lmforge.model.loss import resolve_loss_chunk
    from lmforge.parallel.fsdp import parallelize
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed
    from lmforge.plan.collectives import Collectives
    from lmforge.plan.gpus import gpu_spec
    from lmforge.train.host_memory import retain_freed_memory

    if device_type == "cpu":
        retain_freed_memory()  # as CPU training runs do
    ctx = init_distributed(timeout_minutes=COLLECTIVE_TIMEOUT_S / 60, tp=world)
    try:
        arch = s.llama_arch()
        model = build_model(arch, s.vocab_size, "sdpa", ctx.device, meta=True)
        model.loss_chunk_tokens = resolve_loss_chunk("auto", ctx.device)  # as training chooses it
        parallelize(model, model.blocks, ModelConfig(arch=arch, attn="sdpa", param_dtype="float32"), ctx)
        init_weights(model, s.init_std, s.init_seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        row = {k: v if k == "seq_lens" else v.to(ctx.device) for k, v in _row(s).items()}

        def step(_: int = 0) -> None:
            loss = model(row["input_ids"], row["position_ids"], row["seq_lens"], targets=row["targets"])
            (loss / s.seq_len).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = t._local_tensor if isinstance(t, DTensor) else t
            weights = {_local_ptr(p) for p in model.parameters()}
            ptr = local.untyped_storage().data_ptr()
            if ptr not in weights:
                saved[ptr] = local.untyped_storage().nbytes()
            return t

        grads = 0

        def count_grads() -> None:
            nonlocal grads
            grads = _local_bytes(p.grad for p in model.parameters())

        # Warmup step 0: what autograd saves, and the gradients just before the optimizer consumes them.
        loss = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(row["input_ids"], row["position_ids"], row["seq_lens"], targets=row["targets"])
        (loss / s.seq_len).backward()
        count_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params = _local_bytes(model.parameters())
        state = _local_bytes(t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        comms = Collectives(gpu_spec("h100"), max(world, 1))
        with comms:
            step()
        traffic = {kind: comms.traffic[kind].sent_bytes for kind in KINDS}
        cpu0 = own_cpu_s()
        timing = common.timed_steps(max(s.warmup - 1, 0), s.repeats, step, ctx.device)
        return {
            "cpu_s": own_cpu_s() - cpu0,
            "rank": rank,
            "seconds": timing.seconds,
            "step_s": statistics.median(timing.seconds),
            "foreign_cores": timing.foreign_cores,
            "param_bytes": params,
            "grad_bytes": grads,
            "optimizer_bytes": state,
            "activation_bytes": sum(saved.values()),
            **{f"{kind}_bytes": v for kind, v in traffic.items()},
        }
    finally:
        shutdown_distributed()


def _local_ptr(p: torch.Tensor) -> int:
    """The storage address of a parameter's local part."""
    from torch.distributed.tensor import DTensor

    return (p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr()


MAX_OVER_RANKS = ("step_s", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                  *(f"{kind}_bytes" for kind in KINDS))  # fmt: skip
"""The figures of a configuration that are the maximum over its ranks."""


def measure(tp: int, s: Settings, device: str) -> dict[str, Any]:
    """Run one configuration on `tp` spawned processes and combine their figures (the maximum over ranks)."""
    port = _free_port()
    with ThreadPoolExecutor(tp) as pool:
        futures = [pool.submit(common.run_in_child, run_rank, (r, tp, port, s, device), f"tp-bench-rank{r}", None,
                               s.timeout) for r in range(tp)]  # fmt: skip
        ranks = [f.result() for f in futures]
    for r, result in enumerate(ranks):
        common.raise_for_error(result, f"rank {r} of tp = {tp}")
    row: dict[str, Any] = {"tp": tp, **{k: max(r[k] for r in ranks) for k in MAX_OVER_RANKS}}
    # Another process's CPU time during a rank's timed steps, less what the group's other ranks spent: foreign load.
    other = [max(r["foreign_cores"] - sum(o["cpu_s"] for o in ranks if o is not r) / sum(r["seconds"]), 0.0)
             for r in ranks]  # fmt: skip
    row.update(tokens_per_s=s.seq_len / row["step_s"], foreign_cores=max(other))
    return row


def print_report(rows: list[dict[str, Any]], s: Settings, device: str, console: Any) -> None:
    """The table of every configuration, tp = 1 as the reference."""
    title = (
        f"Tensor parallelism on {device}, tp ranks x 1 thread: d{s.hidden_size} x {s.num_hidden_layers}, "
        f"{s.num_attention_heads} heads ({s.num_key_value_heads} KV), MLP {s.intermediate_size}, vocabulary "
        f"{s.vocab_size}, fp32, AdamW, {s.seq_len} tokens per step (one row), median of {s.repeats} steps; MiB per "
        "rank (max over ranks), collectives sent per rank and step"
    )
    columns = ["tp", "params", "grads", "optimizer", "activations", "vs tp=1", "all-gather", "reduce-scatter",
               "all-reduce", "step s", "tokens/s", "other cores"]  # fmt: skip
    table = common.result_table(title, columns)
    mib = 2**20
    base = next((r for r in rows if r["tp"] == 1), None)
    for row in rows:
        table.add_row(
            str(row["tp"]), f"{row['param_bytes'] / mib:.1f}", f"{row['grad_bytes'] / mib:.1f}",
            f"{row['optimizer_bytes'] / mib:.1f}", f"{row['activation_bytes'] / mib:.1f}",
            f"{row['activation_bytes'] / base['activation_bytes']:.2f}x" if base else "-",
            *(f"{row[f'{kind}_bytes'] / mib:.1f}" for kind in KINDS), f"{row['step_s']:.2f}",
            f"{row['tokens_per_s']:,.0f}", f"{row['foreign_cores']:.2f}",
        )  # fmt: skip
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration (or, with `--peers`, the comparison with torchtitan), print the table, optionally
    write the JSON; 0 when all ran."""
    argv = sys.argv[1:] if argv is None else argv
    if "--peers" in argv:
        import peers

        rest = [a for a in argv if a != "--peers"]
        return peers.main(["--procs", "2", "--tp", "2", "--peers", "torchtitan", *rest])
    presets = {"default": Settings(), "smoke": SMOKE}
    texts = {"repeats": "timed steps per configuration (the median is reported)",
             "warmup": "untimed steps first (the first measures memory and traffic)"}  # fmt: skip
    parser = common.benchmark_parser(__doc__, presets, "tiny model, tp in (1, 2)", quiet_wait="before each "
                                     "configuration", texts=texts)  # fmt: skip
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4], help="TP sizes (default 1 2 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per step (default 1024; smoke 128)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank)")  # fmt: skip
    parser.add_argument("--peers", action="store_true", help="compare with torchtitan's TP instead (peers.py)")
    args = parser.parse_args(argv)
    s = common.with_flags(SMOKE if args.smoke else Settings(), args)
    if args.seq_len is not None:
        s = replace(s, seq_len=args.seq_len)
    tps = [1, 2] if args.smoke else args.tps
    bad = [tp for tp in tps if s.num_key_value_heads % tp or s.intermediate_size % tp or s.seq_len % tp]
    if bad or s.repeats < 1 or s.warmup < 1:
        print(f"tensor_parallel.py: tp must divide the KV heads, the MLP and the row ({bad}); --repeats and --warmup "
              "must be >= 1", file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < max(tps):
        print(f"tensor_parallel.py: --device cuda needs {max(tps)} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)  # fmt: skip
        return 2
    console = common.make_console(190)
    quiet_wait = common.quiet_wait_s(args)
    rows = []
    for tp in tps:
        settle(quiet_wait)
        t0 = time.perf_counter()
        rows.append(measure(tp, s, args.device))
        console.print(f"tp={tp}: {rows[-1]['step_s']:.2f} s a step ({time.perf_counter() - t0:.1f} s)", highlight=False)
    print_report(rows, s, args.device, console)
    common.write_json(args.json, {"device": args.device, "smoke": args.smoke, "settings": asdict(s), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
