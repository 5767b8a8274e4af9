"""Pipeline parallelism: tokens/s, per-rank peak memory and the measured bubble of a training step at pp 1, 2 and 4,
with each of lmforge's pipeline schedules.

For each configuration the script starts pp processes (gloo on the CPU, one compute thread each; NCCL with
`--device cuda`, one GPU per rank) that build the `Trainer` training builds, from one config: a dense Llama (d512 x
8 layers, 8 heads, 4 KV heads, MLP 1408, untied embeddings, vocabulary 8192, fp32) trained with AdamW at a constant
lr on lmforge's fake data, M rows of 512 tokens a step (`--micro-batches`, default 8), documents of mean length 128.
The configurations: pp 1 (one process, no pipeline: the reference); pp 2 with each schedule (`1f1b`,
`interleaved_1f1b`, `interleaved_zb`, `zbv`; two stages per rank but for 1f1b); pp 4 with `1f1b` and
`interleaved_1f1b`. Each rank runs `--warmup` untimed steps, then `--repeats` timed ones, each after a barrier and
timed with perf_counter around `Trainer.train_step`. Per configuration:

- `tokens/s`: the step's tokens over its median time (the slowest rank's median);
- `peak MiB`: each pipeline rank's peak memory (`perf/peak_memory/pp<r>` of the step's metrics). On the CPU it is
  the process's peak RSS, interpreter and libraries included: indicative only;
- `bubble`: the measured idle share of a rank, the mean over ranks of 1 - busy / step time (median over the timed
  steps), busy being the wall time spent inside its stages' `forward_one_chunk`, `backward_one_chunk` and
  `backward_weight_one_chunk` (torch's `PipelineStage` methods, wrapped in each rank's process before the trainer
  is built). The step time also holds the step's reduction and optimizer update, which count as idle; `in
  schedule` is the same share of the schedule's run alone (`Pipeline.step`);
- `theory`: the schedule's bubble, (p - 1) / (m + p - 1) for 1f1b and (p - 1) / (v m + p - 1) for the interleaved
  schedules with v stages per rank (p = pp, m = micro-batches per rank and step). The zero-bubble schedules
  (`interleaved_zb`, `zbv`) get the interleaved figure as an upper bound (`<=`): their split backward fills part of it;
- `loss`: the first step's `loss/mean` against pp 1's, PASS within 1e-5 relative (every layout trains the same
  model on the same rows).

On 2 cores, 4 ranks share the cores, so their step times and bubbles are not those of 4 devices (a rank waiting for
a core counts as busy): the CPU checks that every schedule runs and trains like one process, a GPU node
(`--device cuda`, 4 GPUs) gives the times.

    .venv/bin/python benchmarks/pipeline_parallel.py [--micro-batches M] [--repeats N] [--warmup N]
                                                     [--device cpu|cuda] [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/pipeline_parallel.py --smoke     # d64 x 4 layers, M = 4, pp in (1, 2) (~1 min)
    .venv/bin/python benchmarks/pipeline_parallel.py --peers [peers.py flags]

`--peers` instead compares lmforge's PP with torchtitan's on one pipeline of 2 processes with the 1f1b schedule:
`benchmarks/peers.py --procs 2 --pp 2 --pp-schedule 1f1b --peers torchtitan` (its settings and rules: same model,
weights, tokens, stage cut, threads and allocator for both, 8 micro-batches of one 512-token window a step, tokens/s
and peak memory per side); extra arguments after `--peers` go to it (a later `--pp-schedule` wins).

The script exits 0 when every configuration ran (it is a benchmark, not a test).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

import common
from context_parallel import _free_port
from cpu_load import settle
from lmforge.config import TrainConfig
from lmforge.config.arch import LlamaArch
from lmforge.config.checks import ZERO_BUBBLE, pipeline_problems
from lmforge.parallel.stages import schedule_bubble, stages_per_rank

COLLECTIVE_TIMEOUT_S = 300.0
"""Seconds a rank waits in a collective for the others."""
CONFIGURATIONS = [(1, "-"), *((2, s) for s in ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")),
                  (4, "1f1b"), (4, "interleaved_1f1b")]  # fmt: skip
"""(pp, schedule) of every configuration, pp 1 (no pipeline) first."""
BUSY = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""The `PipelineStage` methods whose wall time counts as a rank's busy time."""
LOSS_RTOL = 1e-5
"""Relative tolerance of the first-step loss against pp 1's."""


@dataclass(frozen=True)
class Settings(common.TrainSettings):
    """The model, the batch and the protocol; `batch_tokens` / `micro_batch_tokens` rows (micro-batches) a step."""

    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 8192
    seq_len: int = 512
    micro_batch_tokens: int = 512
    batch_tokens: int = 512 * 8
    mean_doc_len: float = 128.0
    warmup: int = 2
    repeats: int = 3
    """Timed steps; the median is reported."""
    timeout: float = 1200.0
    """Seconds a configuration may run before its processes are killed."""

    @property
    def micro_batches(self) -> int:
        """Micro-batches a step (one data-parallel rank: all of them go through every pipeline rank)."""
        return self.batch_tokens // self.micro_batch_tokens

    def llama_arch(self) -> LlamaArch:
        """The Llama of these settings, its LM head untied from the embedding (they sit in different stages)."""
        return super().llama_arch().model_copy(update={"tie_word_embeddings": False})

    def config(self, pp: int, schedule: str, output_dir: str) -> TrainConfig:
        """The lmforge config of one configuration: warmup + repeats steps, pipelined when pp > 1."""
        parallel = {"pp": pp, "pp_schedule": schedule} if pp > 1 else {}
        return replace(self, steps=self.repeats).train_config(output_dir, parallel=parallel)


SMOKE = common.tiny(Settings, num_hidden_layers=4, num_key_value_heads=2, vocab_size=512, batch_tokens=4 * 128,
                    timeout=240.0)  # fmt: skip
"""d64 x 4 layers (two stages per rank on 2 ranks), 4 rows of 128 tokens: a check that the script runs."""


def _add_wall_time(cls: type, names: Sequence[str], clock: list[float]) -> None:
    """Wrap the methods `names` of `cls` so that each call's wall time adds to clock[0]; a call made inside another
    wrapped call counts once (the outer one)."""
    depth = [0]

    def wrap(plain: Any) -> Any:
        @functools.wraps(plain)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return plain(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    clock[0] += time.perf_counter() - t0

        return timed

    for name in names:
        setattr(cls, name, wrap(getattr(cls, name)))


def run_rank(rank: int, pp: int, port: int, s: Settings, schedule: str, device: str, out: str) -> dict[str, Any]:
    """One rank of one configuration (in a spawned process): build the trainer, run the steps, time each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(pp))  # fmt: skip
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # init_distributed takes a GPU where it sees one
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lmforge.parallel.pipeline import Pipeline, RowStage
    from lmforge.parallel.process_group import init_distributed, mesh_degrees, shutdown_distributed
    from lmforge.train.trainer import Trainer

    busy, scheduled = [0.0], [0.0]
    wrapped = [name for name in BUSY if hasattr(RowStage, name)]
    _add_wall_time(RowStage, wrapped, busy)
    _add_wall_time(Pipeline, ["step"], scheduled)
    config = s.config(pp, schedule, out)
    ctx = init_distributed(timeout_minutes=COLLECTIVE_TIMEOUT_S / 60, **mesh_degrees(config.parallel))
    try:
        trainer = Trainer(config, ctx, console=False)
        steps: list[tuple[float, float, float, dict[str, float]]] = []
        try:
            for _ in range(s.warmup + s.repeats):
                micro_batches = trainer.data.next_step()
                dist.barrier()
                busy[0] = scheduled[0] = 0.0
                t0 = time.perf_counter()
                metrics = trainer.train_step(micro_batches, 0.0)
                common.sync(ctx.device)
                steps.append((time.perf_counter() - t0, busy[0], scheduled[0], metrics))
        finally:
            trainer.close()
        timed, last = steps[s.warmup :], steps[-1][3]
        memory = [last[f"perf/peak_memory/pp{r}"] for r in range(pp)] if pp > 1 else [last["perf/peak_memory"]]
        return {"rank": rank, "wrapped": wrapped, "first_loss": steps[0][3]["loss/mean"], "peak_gib": memory,
                "seconds": [t[0] for t in timed], "busy_s": [t[1] for t in timed],
                "schedule_s": [t[2] for t in timed]}  # fmt: skip
    finally:
        shutdown_distributed()


def theoretical_bubble(pp: int, schedule: str, m: int) -> float:
    """The schedule's bubble fraction with m micro-batches per rank: (p - 1) / (v m + p - 1), v stages per rank
    (the interleaved 1F1B figure for the zero-bubble schedules, an upper bound there)."""
    return schedule_bubble(pp, stages_per_rank(schedule, None), m)


def _idle(busy: Sequence[float], total: Sequence[float]) -> float:
    """The median over steps of 1 - busy / total."""
    return statistics.median(1 - b / t for b, t in zip(busy, total, strict=True))


def measure(pp: int, schedule: str, s: Settings, device: str) -> dict[str, Any]:
    """Run one configuration on `pp` spawned processes and combine their figures."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as out, ThreadPoolExecutor(pp) as pool:
        futures = [pool.submit(common.run_in_child, run_rank, (r, pp, port, s, schedule, device, out),
                               f"pp-bench-rank{r}", None, s.timeout) for r in range(pp)]  # fmt: skip
        ranks = [f.result() for f in futures]
    for r, result in enumerate(ranks):
        common.raise_for_error(result, f"rank {r} of pp {pp} ({schedule})")
    step_s = max(statistics.median(r["seconds"]) for r in ranks)
    piped = pp > 1
    return {
        "pp": pp, "schedule": schedule, "stages_per_rank": stages_per_rank(schedule, None) if piped else 1,
        "step_s": step_s, "tokens_per_s": s.batch_tokens / step_s, "first_loss": ranks[0]["first_loss"],
        "peak_gib": ranks[0]["peak_gib"], "wrapped": ranks[0]["wrapped"],
        "bubble": statistics.mean(_idle(r["busy_s"], r["seconds"]) for r in ranks) if piped else None,
        "bubble_in_schedule": statistics.mean(_idle(r["busy_s"], r["schedule_s"]) for r in ranks) if piped else None,
        "theory": theoretical_bubble(pp, schedule, s.micro_batches) if piped else None,
        "theory_is_bound": schedule in ZERO_BUBBLE,
    }  # fmt: skip


def _pct(x: float | None) -> str:
    """A fraction as a percentage, `-` for None."""
    return "-" if x is None else f"{100 * x:.1f}%"


def print_report(rows: list[dict[str, Any]], s: Settings, device: str, console: Any) -> bool:
    """The table of every configuration, pp 1 as the reference, and the loss check; whether the check passed."""
    title = (
        f"Pipeline parallelism on {device}, pp ranks x 1 thread: d{s.hidden_size} x {s.num_hidden_layers}, "
        f"{s.num_attention_heads} heads ({s.num_key_value_heads} KV), MLP {s.intermediate_size}, vocabulary "
        f"{s.vocab_size}, fp32, AdamW, {s.micro_batches} micro-batches of {s.micro_batch_tokens} tokens a step, "
        f"median of {s.repeats} steps; peak memory per pipeline rank"
        + (" (CPU: peak RSS, indicative only)" if device == "cpu" else "")
        + "; bubble: mean over ranks; theory <=: upper bound (zero-bubble schedules)"
    )
    columns = ["pp", "schedule", "stages/rank", "step s", "tokens/s", "vs pp 1", "peak MiB per rank", "bubble",
               "in schedule", "theory", "loss", "vs pp 1 loss"]  # fmt: skip
    table = common.result_table(title, columns, left=["pp", "schedule", "peak MiB per rank"])
    base = rows[0]
    ok = True
    for row in rows:
        rel = abs(row["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
        ok = ok and rel <= LOSS_RTOL
        table.add_row(
            str(row["pp"]), row["schedule"], str(row["stages_per_rank"]), f"{row['step_s']:.3f}",
            f"{row['tokens_per_s']:,.0f}", f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x",
            " / ".join(f"{g * 1024:.0f}" for g in row["peak_gib"]), _pct(row["bubble"]),
            _pct(row["bubble_in_schedule"]), ("<= " if row["theory_is_bound"] else "") + _pct(row["theory"]),
            f"{row['first_loss']:.6f}", common.verdict(rel <= LOSS_RTOL) + f" {rel:.1e}",
        )  # fmt: skip
    console.print(table)
    console.print(f"first-step loss/mean of every configuration equals pp 1's within {LOSS_RTOL:g} relative: "
                  f"{common.verdict(ok)}; busy time: {', '.join(base['wrapped'])}")  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    """Run every configuration (or, with `--peers`, the comparison with torchtitan), print the table and the loss
    check, optionally write the JSON; 0 when all ran."""
    argv = sys.argv[1:] if argv is None else argv
    if "--peers" in argv:
        import peers

        rest = [a for a in argv if a != "--peers"]
        return peers.main(["--procs", "2", "--pp", "2", "--pp-schedule", "1f1b", "--peers", "torchtitan", *rest])
    presets = {"default": Settings(), "smoke": SMOKE}
    texts = {"repeats": "timed steps per configuration (the median is reported)"}
    parser = common.benchmark_parser(__doc__, presets, "d64 x 4 layers, 4 micro-batches, pp in (1, 2)",
                                     quiet_wait="before each configuration", skip={"steps"}, texts=texts)  # fmt: skip
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches a step (default 8; smoke 4)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank)")  # fmt: skip
    parser.add_argument("--peers", action="store_true", help="compare with torchtitan's PP instead (peers.py)")
    args = parser.parse_args(argv)
    s = common.with_flags(SMOKE if args.smoke else Settings(), args)
    if args.micro_batches is not None:
        s = replace(s, batch_tokens=args.micro_batches * s.micro_batch_tokens)
    configurations = [(pp, schedule) for pp, schedule in CONFIGURATIONS if not (args.smoke and pp > 2)]
    problems = [f"pp {pp} {schedule}: {field} {text}" for pp, schedule in configurations
                for field, text in pipeline_problems(s.config(pp, schedule, "unused"), pp)]  # fmt: skip
    if s.repeats < 1 or s.warmup < 0:
        problems.append("--repeats must be >= 1 and --warmup >= 0")
    if problems:
        print("pipeline_parallel.py: " + "; ".join(problems), file=sys.stderr)
        return 2
    most = max(pp for pp, _ in configurations)
    if args.device == "cuda" and torch.cuda.device_count() < most:
        print(f"pipeline_parallel.py: --device cuda needs {most} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)  # fmt: skip
        return 2
    console = common.make_console(200)
    quiet_wait = common.quiet_wait_s(args)
    rows = []
    for pp, schedule in configurations:
        settle(quiet_wait)
        t0 = time.perf_counter()
        rows.append(measure(pp, schedule, s, args.device))
        console.print(f"pp={pp} {schedule}: {rows[-1]['step_s']:.3f} s a step ({time.perf_counter() - t0:.1f} s)",
                      highlight=False)  # fmt: skip
    loss_ok = print_report(rows, s, args.device, console)
    common.write_json(args.json, {"device": args.device, "smoke": args.smoke, "settings": asdict(s),
                                  "loss_check": loss_ok, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
