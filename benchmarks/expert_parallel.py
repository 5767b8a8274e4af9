"""Expert parallelism: training tokens/s, per-rank memory and communication of an MoE at ep = 1 and ep = 2.

For each number of routed experts E (8, 16, 32 by default) and each ep, the script starts 2 processes (gloo on the
CPU, one compute thread each; NCCL with `--device cuda`, one GPU per rank) that build the same GLM-4.5 MoE the way
training does (`build_model` on the meta device, `parallelize` with the `DistContext` of `init_distributed(ep=...)`,
`init_weights(std 0.02, seed 0)`; fp32): d256 x 4 layers, the first dense (MLP 768), 4 heads, each MoE block E
routed experts of width 256, top-2, 1 shared expert. At ep = 1 the 2 ranks are data-parallel and FSDP shards every
expert stack over both; at ep = 2 each rank holds E / 2 experts whole and the token copies travel by all-to-all.
Each rank trains on its own packed row of `seq_len` (1024) random tokens in documents of mean length 256, the same
rows at every ep: the same tokens per rank and per step everywhere. A timed step is forward + backward (the loss
over the step's tokens), without an optimizer step: the optimizer updates the same shards at both ep (see
`expert shard` below), so it would add the same time to both. Per configuration, the maximum over the ranks of:

- `tokens/s`: the step's tokens (both ranks) over the median of `--repeats` timed steps after `--warmup` untimed;
- `expert weights`: bytes of the expert stacks a rank computes with (read inside `Experts.forward`, all MoE
  layers): FSDP gathers all E experts at ep = 1, a rank uses its E / 2 at ep = 2;
- `expert shard`: bytes of expert weights a rank holds between steps (its local shards): E / 2 experts' worth at
  both ep, since FSDP already splits the stacks over the 2 ranks at ep = 1;
- `params + grads`: bytes of all parameters and gradients a rank holds after backward (local shards);
- `activations`: bytes of the tensors autograd saves for backward (each storage once, weights left out);
- `all-to-all`: bytes a rank hands to `all_to_all_single` per step for the token copies (dispatch and combine in
  forward, their gradients in backward; counted by wrapping `torch.distributed.all_to_all_single`), of which
  `to peers` leaves the rank (the rest is its copies for its own experts); the per-expert counts exchanged by
  `plan_exchange` are counted apart (`counts`);
- `plan`: seconds per step inside `plan_exchange` (the counts' all-to-all and the one host read of the send and
  receive sizes, once per MoE layer and forward: a device sync on CUDA), and `a2a`: seconds per step inside the
  copies' `all_to_all_single` calls (on gloo: the transfer plus any wait for the other rank);
- `FSDP gather` / `FSDP reduce`: bytes a rank receives in FSDP's all-gathers and sends in its reduce-scatters per
  step (every unit; wrapping `all_gather_single` and `reduce_scatter_single`, a group of one counting 0). The
  non-expert units are the same at both ep, so the difference between ep = 1 and ep = 2 is the experts' traffic;
- `rank load`: token copies the busiest rank's experts computed over the mean (`Experts.tokens_computed`).

Expected: a rank computes about as many expert rows at both ep (its share of all copies), so the step differs by
communication: ep = 2 trades FSDP's gather (twice per step: forward and the backward re-gather) and reduce-scatter
of half of every expert stack, which grow with E, for 4 all-to-alls of the token copies per MoE layer, which do not
(4 x tokens x top-k x hidden x 4 bytes per rank and layer, half of it to the peer on average). ep = 2 should then
gain with E; the expert weights a rank computes with halve, the shards it holds do not. On 2 cores the 2 ranks have
a core each, and gloo copies through the host: GPU/NCCL figures differ.

    .venv/bin/python benchmarks/expert_parallel.py [--experts 8 16 32] [--eps 1 2] [--repeats N] [--warmup N]
                                                   [--seq-len T] [--device cpu|cuda] [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/expert_parallel.py --smoke      # tiny model, E in (4, 8), ep in (1, 2) (~30 s)

The script exits 0 when every configuration ran (it is a benchmark, not a test).
"""

from __future__ import annotations

import functools
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

import common
from context_parallel import _free_port
from cpu_load import own_cpu_s, settle
from lmforge.config.arch import Glm4MoeArch

RANKS = 2
"""Processes of every configuration: data-parallel at ep = 1, one expert-parallel group at ep = 2."""
COLLECTIVE_TIMEOUT_S = 120.0
"""Seconds a rank waits in a collective for the other one (its steps take seconds)."""
SHAPE = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "max_position_embeddings"}  # fmt: skip
"""The fields the MoE takes from the Llama architecture of the settings."""


@dataclass(frozen=True)
class Settings(common.ModelSettings):
    """The MoE, the rows and the protocol; `seq_len` is each rank's tokens per step (one packed row)."""

    intermediate_size: int = 768
    """Width of the first (dense) block's MLP."""
    num_hidden_layers: int = 4
    vocab_size: int = 1024
    seq_len: int = 1024
    moe_intermediate_size: int = 256
    """Width of one expert's SwiGLU (routed and shared)."""
    top_k: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    mean_doc_len: float = 256.0
    warmup: int = 1
    """Untimed steps first (the first also measures the memory figures)."""
    repeats: int = 5
    """Timed steps; the median is reported."""
    timeout: float = 600.0
    """Seconds a configuration may run before its processes are killed."""

    def arch(self, experts: int) -> Glm4MoeArch:
        """The GLM-4.5 MoE of these settings with `experts` routed experts per MoE block."""
        return Glm4MoeArch(
            **self.llama_arch().model_dump(include=SHAPE),
            moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=experts,
            num_experts_per_tok=self.top_k,
            n_shared_experts=self.n_shared_experts,
            first_k_dense_replace=self.first_k_dense_replace,
        )


SMOKE = common.tiny(Settings, moe_intermediate_size=32, seq_len=128, mean_doc_len=32.0, timeout=240.0)
"""d64 x 2 (one MoE block), 128 tokens per rank: a check that the script runs, in seconds."""


# ---------------------------------------------------------------------------------------------- one rank


def _row(s: Settings, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s packed row: random tokens in documents of random lengths (mean `mean_doc_len`), the same at
    every ep and E."""
    rng = np.random.default_rng(1000 + rank)
    lens: list[int] = []
    while sum(lens) < s.seq_len:
        lens.append(int(min(rng.integers(1, 2 * s.mean_doc_len), s.seq_len - sum(lens))))
    tokens = torch.from_numpy(rng.integers(1, s.vocab_size, size=s.seq_len + 1))
    return {
        "input_ids": tokens[:-1][None],
        "targets": tokens[1:][None],
        "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }


class Meter:
    """Counters of one rank's collectives and exchange planning, filled by wrapping the torch.distributed calls."""

    def __init__(self) -> None:
        """All counters at zero."""
        self.a2a_bytes = self.a2a_remote_bytes = self.count_bytes = 0
        self.gather_bytes = self.reduce_bytes = 0
        self.plan_s = self.a2a_s = 0.0
        self.planning = False

    def reset(self) -> None:
        """Zero every counter."""
        self.__init__()  # type: ignore[misc]

    def figures(self) -> dict[str, float]:
        """The counters by name."""
        return {k: v for k, v in vars(self).items() if k != "planning"}


def _wrap(module: Any, name: str, count: Callable[[inspect.BoundArguments], Callable[[float], None] | None]) -> None:
    """Replace `module.name` with a function that calls `count` with its bound arguments, then the original; when
    `count` returns a function, that one gets the seconds the original took."""
    original = getattr(module, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        timer = count(signature.bind(*args, **kwargs))
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if timer is not None:
                timer(time.perf_counter() - t0)

    setattr(module, name, counting)


def _instrument(meter: Meter) -> None:
    """Count the bytes of every all-to-all, FSDP all-gather and reduce-scatter, and time the exchange planning and
    the copies' all-to-alls."""
    import torch.distributed as dist

    import lmforge.parallel.experts as experts

    def group_of(b: inspect.BoundArguments) -> tuple[int, int]:
        group = b.arguments.get("group")
        return dist.get_world_size(group), dist.get_rank(group)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def add_a2a_time(seconds: float) -> None:
        meter.a2a_s += seconds

    def all_to_all(b: inspect.BoundArguments) -> Callable[[float], None] | None:
        x = b.arguments["input"]
        if meter.planning:
            meter.count_bytes += nbytes(x)
            return None
        size, me = group_of(b)
        splits = b.arguments.get("input_split_sizes") or [x.shape[0] // size] * size
        row = nbytes(x) // max(x.shape[0], 1)
        meter.a2a_bytes += nbytes(x)
        meter.a2a_remote_bytes += row * sum(n for r, n in enumerate(splits) if r != me)
        return add_a2a_time

    def gather(b: inspect.BoundArguments) -> None:
        size, _ = group_of(b)
        meter.gather_bytes += nbytes(b.arguments["output_tensor"]) * (size - 1) // size

    def reduce(b: inspect.BoundArguments) -> None:
        size, _ = group_of(b)
        meter.reduce_bytes += nbytes(b.arguments["input"]) * (size - 1) // size

    _wrap(dist, "all_to_all_single", all_to_all)
    _wrap(dist, "all_gather_single", gather)
    _wrap(dist, "reduce_scatter_single", reduce)

    plan = experts.plan_exchange

    def timed_plan(*args: Any, **kwargs: Any) -> Any:
        meter.planning = True
        t0 = time.perf_counter()
        try:
            return plan(*args, **kwargs)
        finally:
            meter.plan_s += time.perf_counter() - t0
            meter.planning = False

    experts.plan_exchange = timed_plan  # type: ignore[assignment]


def _local_bytes(tensors: Any) -> int:
    """Bytes of the local parts of `tensors` (DTensors: this rank's shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is not None:
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def run_rank(rank: int, port: int, experts: int, ep: int, s: Settings, device_type: str) -> dict[str, Any]:
    """One rank of one configuration (in a spawned process): build, warm up, measure, return its figures."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(RANKS))  # fmt: skip
    torch.set_num_threads(1)
    from lmforge.config.model import ModelConfig
    from lmforge.model import build_model
    from lmforge.model.init import init_weights
    from lmforge.model.moe import Experts
    from lmforge.parallel.fsdp import parallelize
    from lmforge.parallel.process_group import init_distributed, shutdown_distributed
    from lmforge.train.host_memory import retain_freed_memory

    if device_type == "cpu":
        retain_freed_memory()  # as CPU training runs do: freed buffers are reused, not faulted in again each step
    meter = Meter()
    _instrument(meter)
    # A collective waits at most this long: a rank that failed stops the other one soon, not after `s.timeout`.
    ctx = init_distributed(timeout_minutes=min(s.timeout, COLLECTIVE_TIMEOUT_S) / 60, ep=ep)
    try:
        arch = s.arch(experts)
        model = build_model(arch, s.vocab_size, "sdpa", ctx.device, meta=True)
        parallelize(model, model.blocks, ModelConfig(arch=arch, attn="sdpa", param_dtype="float32"), ctx)
        init_weights(model, s.init_std, s.init_seed)
        model.train()
        modules = [m for m in model.modules() if isinstance(m, Experts)]
        expert_shard = _local_bytes(p for m in modules for p in m.parameters())
        row = {k: v if k == "seq_lens" else v.to(ctx.device) for k, v in _row(s, rank).items()}

        def step(_: int = 0) -> None:
            loss = model(row["input_ids"], row["position_ids"], row["seq_lens"], targets=row["targets"])
            (loss / (RANKS * s.seq_len)).backward()

        # Warmup step 0 measures memory: the expert weights each Experts.forward sees (FSDP has gathered them by
        # then), and what autograd saves for backward apart from weights (those being used are the parameters of
        # the unit FSDP has unsharded at that moment, so look them up as each tensor is saved).
        computed_with: list[int] = []
        hooks = [m.register_forward_pre_hook(lambda m, _: computed_with.append(_local_bytes(m.parameters())))
                 for m in modules]  # fmt: skip
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            from torch.distributed.tensor import DTensor

            weights = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                       for p in model.parameters()}  # fmt: skip
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
        for hook in hooks:
            hook.remove()
        params = _local_bytes(model.parameters())
        grads = _local_bytes(p.grad for p in model.parameters())
        model.zero_grad(set_to_none=True)
        for _ in range(1, s.warmup):
            step()
            model.zero_grad(set_to_none=True)
        model.reset_moe_stats()
        meter.reset()

        def timed(i: int) -> None:
            step(i)
            model.zero_grad(set_to_none=True)

        cpu0 = own_cpu_s()
        timing = common.timed_steps(0, s.repeats, timed, ctx.device)
        cpu_s = own_cpu_s() - cpu0
        computed = sum(float(m.tokens_computed) for m in modules) / s.repeats
        per_step = {k: v / s.repeats for k, v in meter.figures().items()}
        return {
            "rank": rank,
            "seconds": timing.seconds,
            "step_s": statistics.median(timing.seconds),
            "cpu_s": cpu_s,
            "foreign_cores": timing.foreign_cores,
            "expert_weight_bytes": sum(computed_with),
            "expert_shard_bytes": expert_shard,
            "param_bytes": params,
            "grad_bytes": grads,
            "activation_bytes": sum(saved.values()),
            "copies_computed": computed,
            **per_step,
        }
    finally:
        shutdown_distributed()


# ---------------------------------------------------------------------------------------------- one configuration


MAX_OVER_RANKS = ("step_s", "expert_weight_bytes", "expert_shard_bytes", "param_bytes", "grad_bytes",
                  "activation_bytes", "a2a_bytes", "a2a_remote_bytes", "count_bytes", "gather_bytes", "reduce_bytes",
                  "plan_s", "a2a_s")  # fmt: skip
"""The figures of a configuration that are the maximum over its ranks."""


def measure(experts: int, ep: int, s: Settings, device: str) -> dict[str, Any]:
    """Run one configuration on `RANKS` spawned processes (each killed after `s.timeout` seconds) and combine
    their figures: the maximum over ranks of each, tokens/s from the slowest rank's median step."""
    port = _free_port()
    with ThreadPoolExecutor(RANKS) as pool:
        args = [(r, port, experts, ep, s, device) for r in range(RANKS)]
        futures = [pool.submit(common.run_in_child, run_rank, a, f"ep-bench-rank{a[0]}", None, s.timeout) for a in args]
        ranks = [f.result() for f in futures]
    for r, result in enumerate(ranks):
        common.raise_for_error(result, f"rank {r} of E = {experts}, ep = {ep}")
    row: dict[str, Any] = {"experts": experts, "ep": ep, **{k: max(r[k] for r in ranks) for k in MAX_OVER_RANKS}}
    tokens = RANKS * s.seq_len
    loads = [r["copies_computed"] for r in ranks]
    # Another process's CPU time during a rank's timed steps, less what the other rank spent: foreign load.
    other = [max(r["foreign_cores"] - sum(o["cpu_s"] for o in ranks if o is not r) / sum(r["seconds"]), 0.0)
             for r in ranks]  # fmt: skip
    row.update(
        tokens_per_step=tokens,
        tokens_per_rank=s.seq_len,
        tokens_per_s=tokens / row["step_s"],
        copies_computed=loads,
        rank_load_max_over_mean=max(loads) / statistics.mean(loads) if sum(loads) else None,
        foreign_cores=max(other),
        ranks=ranks,
    )
    return row


# ---------------------------------------------------------------------------------------------- report


def print_report(rows: list[dict[str, Any]], s: Settings, device: str, console: Any) -> None:
    """The table of every configuration, ep = 1 of the same E as the reference."""
    title = (
        f"Expert parallelism on {device}, {RANKS} ranks x 1 thread: d{s.hidden_size} x {s.num_hidden_layers} "
        f"({s.first_k_dense_replace} dense), experts of width {s.moe_intermediate_size}, top-{s.top_k}, "
        f"{s.n_shared_experts} shared, fp32, {s.seq_len} tokens per rank and step, forward + backward, median of "
        f"{s.repeats} steps after {s.warmup}; bytes and seconds per rank and step (max over ranks)"
    )
    columns = ["E", "ep", "tokens/s", "vs ep=1", "expert weights MiB", "expert shard MiB", "params+grads MiB",
               "activations MiB", "all-to-all MiB", "to peers MiB", "plan ms", "a2a ms", "FSDP gather MiB",
               "FSDP reduce MiB", "rank load", "other cores"]  # fmt: skip
    table = common.result_table(title, columns)
    mib = 2**20
    for row in rows:
        base = next((r for r in rows if r["experts"] == row["experts"] and r["ep"] == 1), None)
        load = row["rank_load_max_over_mean"]
        table.add_row(
            str(row["experts"]), str(row["ep"]), f"{row['tokens_per_s']:,.0f}",
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
            f"{row['expert_weight_bytes'] / mib:.2f}", f"{row['expert_shard_bytes'] / mib:.2f}",
            f"{(row['param_bytes'] + row['grad_bytes']) / mib:.2f}", f"{row['activation_bytes'] / mib:.1f}",
            f"{row['a2a_bytes'] / mib:.2f}", f"{row['a2a_remote_bytes'] / mib:.2f}", f"{row['plan_s'] * 1e3:.2f}",
            f"{row['a2a_s'] * 1e3:.1f}", f"{row['gather_bytes'] / mib:.2f}", f"{row['reduce_bytes'] / mib:.2f}",
            f"{load:.2f}" if load is not None else "-", f"{row['foreign_cores']:.2f}",
        )  # fmt: skip
    console.print(table)
    busy = [f"E={r['experts']} ep={r['ep']}" for r in rows if r["foreign_cores"] > 0.1]
    if busy:
        console.print(f"[yellow]other processes used the CPUs during {', '.join(busy)} (> 0.1 cores): their times "
                      "are not reliable; rerun on an idle machine[/]")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table, optionally write the JSON; 0 when all ran."""
    presets = {"default": Settings(), "smoke": SMOKE}
    texts = {"repeats": "timed steps per configuration (the median is reported)",
             "warmup": "untimed steps first (the first measures the memory figures)"}  # fmt: skip
    parser = common.benchmark_parser(__doc__, presets, "tiny model, E in (4, 8), ep in (1, 2)",
                                     quiet_wait="before each configuration", texts=texts)  # fmt: skip
    experts_help = "routed experts per MoE block (default 8 16 32; smoke 4 8)"
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32], help=experts_help)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2], help=f"expert-parallel sizes, dividing {RANKS}")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per rank and step (default 1024; smoke 128)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank)")  # fmt: skip
    args = parser.parse_args(argv)
    s = common.with_flags(SMOKE if args.smoke else Settings(), args)
    if args.seq_len is not None:
        s = replace(s, seq_len=args.seq_len)
    experts, eps = ([4, 8], [1, 2]) if args.smoke else (args.experts, args.eps)
    if s.repeats < 1 or s.warmup < 1:
        print("expert_parallel.py: --repeats and --warmup must be >= 1", file=sys.stderr)
        return 2
    if bad := [(e, ep) for e in experts for ep in eps if RANKS % ep or e % ep]:
        print(f"expert_parallel.py: ep must divide {RANKS} and E: {bad}", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < RANKS:
        print(f"expert_parallel.py: --device cuda needs {RANKS} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)  # fmt: skip
        return 2
    console = common.make_console(190)
    quiet_wait = common.quiet_wait_s(args)
    rows = []
    for e in experts:
        for ep in eps:
            settle(quiet_wait)
            t0 = time.perf_counter()
            rows.append(measure(e, ep, s, args.device))
            console.print(f"E={e} ep={ep}: {rows[-1]['tokens_per_s']:,.0f} tokens/s ({time.perf_counter() - t0:.1f} s)",
                          highlight=False)  # fmt: skip
    print_report(rows, s, args.device, console)
    common.write_json(args.json, {"device": args.device, "smoke": args.smoke, "ranks": RANKS,
                                  "settings": asdict(s), "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
