"""`lmforge plan @ run.toml [--section.field VALUE ...] [--gpus N] [--gpu h100] [--json FILE]`: will this config fit,
and how fast will it go, on N GPUs? One training step on fake tensors, on this machine's CPU (docs/plan.md).

Plan flags (the rest is the run's config, exactly as `lmforge train` takes it):
  --gpus N            GPUs of the run (default: [deployment] num_nodes x procs_per_node)
  --gpus-per-node N   GPUs per node (default: [deployment] procs_per_node when it is over 1, else 8)
  --gpu NAME          h100 (default), h200, a100, a100-40gb, b200
  --doc-len N         plan with documents of geometric length, mean N tokens, instead of the run's data
  --vocab-size N      the vocabulary when the run's tokenizer is not at hand (default 32000)
  --headroom F        share of GPU memory left free (default 0.1)
  --no-suggest        when it does not fit, do not plan the changes that would make it fit
  --json FILE         write every figure to FILE
  --check-cuda        instead of the plan, run the step on fake CUDA tensors and report every device, dtype or
                      host-read error with its module and line (needs the CUDA build of torch, not a GPU)

Exit codes: 0 fits (with --check-cuda: no problem), 1 does not fit (problems found), 2 bad input (or, with
--check-cuda, a CPU-only torch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.commands.errors import fail

if TYPE_CHECKING:
    from lmforge.config.train import TrainConfig
    from lmforge.plan.gpus import GpuSpec

DOES_NOT_FIT = 1
"""The exit code of a config whose step does not fit in the GPU's memory."""

_VALUE_FLAGS = {"--gpus": int, "--gpus-per-node": int, "--gpu": str, "--doc-len": float, "--vocab-size": int,
                "--headroom": float, "--json": str}  # fmt: skip


def _split(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    """The plan's own flags, and the rest (the run's config)."""
    flags: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _VALUE_FLAGS:
            if i + 1 == len(argv):
                raise ValueError(f"{arg} needs a value")
            try:
                flags[arg] = _VALUE_FLAGS[arg](argv[i + 1])
            except ValueError:
                raise ValueError(f"{arg} {argv[i + 1]!r} is not a valid {_VALUE_FLAGS[arg].__name__}") from None
            i += 2
        elif arg in ("--no-suggest", "--check-cuda"):
            flags[arg] = True
            i += 1
        else:
            rest.append(arg)
            i += 1
    return flags, rest


def main(argv: list[str]) -> int:
    """Plan one step of the config on the target GPUs; returns 0 (fits), 1 (does not fit) or 2 (bad input)."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        flags, rest = _split(argv)
    except ValueError as e:
        return fail("plan", str(e))
    from lmforge.config import ConfigError, load_train_config

    gpus = flags.get("--gpus")
    if gpus is not None and int(gpus) < 1:  # type: ignore[call-overload]
        return fail("plan", f"--gpus must be at least 1, got {gpus}")
    try:
        # Without --gpus, the world size of the config's [deployment] (nodes x processes per node).
        config, _ = load_train_config(rest, None if gpus is None else int(gpus))  # type: ignore[call-overload]
    except ConfigError as e:
        return fail("plan", str(e))
    if config.parallel.pp > 1 and flags.get("--check-cuda"):
        return fail("plan", f"parallel.pp = {config.parallel.pp}: --check-cuda does not run pipeline stages yet; check "
                    "the same model with parallel.pp = 1")  # fmt: skip
    deployment = config.deployment
    world = int(gpus) if gpus is not None else deployment.num_nodes * deployment.procs_per_node  # type: ignore[call-overload]
    per_node = int(flags.get("--gpus-per-node", deployment.procs_per_node if deployment.procs_per_node > 1 else 8))  # type: ignore[call-overload]
    from lmforge.plan.gpus import gpu_spec
    from lmforge.plan.report import DEFAULT_HEADROOM

    try:
        gpu = gpu_spec(str(flags.get("--gpu", "h100")))
    except ValueError as e:
        return fail("plan", str(e))
    if flags.get("--check-cuda"):
        return _check_cuda(config, world, flags)
    headroom = float(flags.get("--headroom", DEFAULT_HEADROOM))  # type: ignore[arg-type]
    if not 0 <= headroom < 1:
        return fail("plan", f"--headroom must be in [0, 1), got {headroom}")
    try:
        result = plan_and_report(
            config,
            world,
            per_node,
            gpu,
            headroom,
            flags.get("--doc-len"),  # type: ignore[arg-type]
            flags.get("--vocab-size"),
            not flags.get("--no-suggest"),
            "plan",
        )  # type: ignore[arg-type]
    except ValueError as e:
        return fail("plan", str(e))
    if "--json" in flags:
        Path(str(flags["--json"])).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["fits"] else DOES_NOT_FIT


def _check_cuda(config: TrainConfig, world: int, flags: dict[str, object]) -> int:
    """`--check-cuda`: the step on fake CUDA tensors; 0 when clean, 1 with problems, 2 without a CUDA build."""
    from rich.console import Console

    from lmforge.plan.cuda_check import CudaBuildMissing, check_cuda, render_check

    start = time.perf_counter()
    try:
        check = check_cuda(config, world, flags.get("--doc-len"), flags.get("--vocab-size"))  # type: ignore[arg-type]
    except CudaBuildMissing as e:
        return fail("plan", str(e))
    except ValueError as e:
        return fail("plan", str(e))
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    render_check(check, Console(highlight=False, width=None if wide else 120))
    print(f"checked in {time.perf_counter() - start:.1f} s")
    if "--json" in flags:
        problems = [{**dataclasses.asdict(p), "times": check.counts[p]} for p in check.problems]
        record = {"world_size": world, "ok": check.ok, "choices": check.choices, "notes": check.notes,
                  "backward_nodes": check.backward_nodes.total(), "own_backwards": dict(check.own_backwards),
                  "problems": problems}  # fmt: skip
        Path(str(flags["--json"])).write_text(json.dumps(record, indent=2) + "\n")
    if not check.ok:
        print(f"lmforge plan: the CUDA check found {len(check.problems)} problem(s); the first: "
              f"{check.problems[0].where}: {check.problems[0].error}", file=sys.stderr)  # fmt: skip
    return 0 if check.ok else DOES_NOT_FIT


def plan_and_report(
    config: TrainConfig,
    world: int,
    per_node: int,
    gpu: GpuSpec,
    headroom: float,
    doc_len: float | None = None,
    vocab: int | None = None,
    suggest: bool = True,
    command: str = "plan",
) -> dict[str, Any]:
    """Plan one step of `config` on `world` GPUs, print the report (and, when it does not fit, one line on stderr
    naming the shortfall and the changes that fit, planned when `suggest`); returns every figure
    (`PlanReport.to_json`, with `suggestions` when it does not fit, and `hybrid_sharding_hint` when a multi-node
    step is bound by its collectives and `suggest`). Raises ValueError for a config the target
    GPU cannot run at all (FP8 on a GPU without FP8 tensor cores)."""
    from rich.console import Console

    from lmforge.plan.fit import hybrid_sharding_hint, suggestions
    from lmforge.plan.ranks import plan_run
    from lmforge.plan.report import PlanReport, render

    if config.model.fp8 != "none" and not config.model.fp8_emulate and not gpu.fp8:
        raise ValueError(f"model.fp8 = {config.model.fp8!r} needs FP8 tensor cores, which {gpu.name} lacks")

    def plan(cfg: TrainConfig) -> PlanReport:
        return PlanReport(plan_run(cfg, world, gpu, per_node, doc_len, vocab), gpu, world, per_node, headroom)

    start = time.perf_counter()
    report = plan(config)
    # Written to a file (a Slurm job's log, a CI log) the tables keep 120 columns instead of rich's 80 (COLUMNS,
    # where set, still decides).
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(highlight=False, width=None if wide else 120)
    render(report, console)
    console.print(f"planned in {time.perf_counter() - start:.1f} s")
    result = report.to_json()
    hint = hybrid_sharding_hint(config, report, plan) if suggest else ""
    if hint:
        console.print(f"hint: {hint}", highlight=False)
        result["hybrid_sharding_hint"] = hint
    if not report.fits:
        hints = suggestions(config, plan) if suggest else []
        result["suggestions"] = hints
        fix = f"; it fits with {' or '.join(hints)}" if hints else (
            "; no smaller micro-batch or checkpointing fits" if suggest else "")  # fmt: skip
        print(f"lmforge {command}: does not fit: the step's peak is {report.plan.peak_bytes / 2**30:.2f} GiB per GPU, "
              f"{report.shortfall_gib:.2f} GiB over the {report.budget_bytes / 2**30:.2f} GiB budget of a "
              f"{gpu.name}{fix}", file=sys.stderr)  # fmt: skip
    return result
