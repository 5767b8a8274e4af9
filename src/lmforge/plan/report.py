"""What a plan prints and writes: memory per GPU by category against the GPU's, FLOPs, the estimated step time,
tokens/s and MFU, and the collectives; whether the config fits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from lmforge.plan.gpus import GIB, GpuSpec
from lmforge.plan.step import StepPlan

DEFAULT_HEADROOM = 0.1
"""Share of a GPU's memory a plan leaves free: the CUDA context, NCCL's buffers and the allocator's fragmentation."""


@dataclass
class PlanReport:
    """A step plan for one target, with the verdict."""

    plan: StepPlan
    """The traced step."""
    gpu: GpuSpec
    """The target GPU."""
    world_size: int
    """GPUs of the run."""
    gpus_per_node: int
    """GPUs per node (which collectives stay on NVLink)."""
    headroom: float
    """Share of the GPU's memory left free."""

    @property
    def budget_bytes(self) -> float:
        """Memory the step may use on one GPU."""
        return self.gpu.memory_gib * GIB * (1 - self.headroom)

    @property
    def memory_known(self) -> bool:
        """Whether this torch's memory tracker gave the step's memory."""
        return bool(self.plan.memory)

    @property
    def fits(self) -> bool:
        """Whether the step's peak stays within the budget (assumed when the memory is not known: see the notes)."""
        return not self.memory_known or self.plan.peak_bytes <= self.budget_bytes

    @property
    def shortfall_gib(self) -> float:
        """GiB over the budget (0 when it fits)."""
        return max(0.0, (self.plan.peak_bytes - self.budget_bytes) / GIB)

    @property
    def tokens_per_s(self) -> float:
        """Estimated tokens per second per GPU."""
        return self.plan.tokens / self.plan.step_seconds

    @property
    def mfu(self) -> float:
        """The MFU the estimated step time implies (lmforge's FLOP count over the GPU's bf16 peak)."""
        return self.plan.flops / (self.plan.step_seconds * self.gpu.peak_flops)

    def to_json(self) -> dict[str, Any]:
        """Every figure of the report, in bytes, FLOPs and seconds."""
        p = self.plan
        return {
            "gpu": self.gpu.name, "world_size": self.world_size, "gpus_per_node": self.gpus_per_node,
            "fits": self.fits, "memory_known": self.memory_known, "memory_bytes": p.memory, "peak_bytes": p.peak_bytes,
            "budget_bytes": self.budget_bytes, "gpu_memory_bytes": self.gpu.memory_gib * GIB,
            "headroom": self.headroom, "tokens_per_step": p.tokens, "micro_batches": p.micro_batches,
            "flops_per_step": p.flops, "flops_6nd_per_step": p.dense_flops, "traced_flops": p.traced_flops,
            "optimizer_flops": p.optimizer_flops,
            "compute_seconds": p.compute_seconds, "comm_seconds": p.comm_seconds,
            "tensor_parallel_comm_seconds": p.in_line_seconds,
            "step_seconds_estimate": p.step_seconds, "tokens_per_s_per_gpu_estimate": self.tokens_per_s,
            "mfu_estimate": self.mfu,
            "collectives": {k: vars(v) for k, v in sorted(p.comms.items())},
            "choices": p.choices, "batches": p.batches_source, "notes": p.notes,
            **({"pipeline_bubble": p.bubble, "pipeline_ranks": p.pipeline_ranks} if p.pipeline_ranks else {}),
        }  # fmt: skip


def render(report: PlanReport, console: Console) -> None:
    """Print the report's tables and notes."""
    p, gpu = report.plan, report.gpu
    nodes = -(-report.world_size // report.gpus_per_node)
    console.print(f"[bold]plan[/]: {report.world_size} x {gpu.name} ({nodes} node{'s' * (nodes > 1)} of "
                  f"{report.gpus_per_node}), rank 0, one optimizer step of {p.micro_batches} micro-batches "
                  f"({p.tokens:,} tokens on this GPU)", highlight=False)  # fmt: skip
    for what, choice in p.choices.items():
        console.print(f"  {what}: {choice}", highlight=False)
    console.print(f"  document lengths: {p.batches_source}", highlight=False)

    if not report.memory_known:
        console.print("[bold red]memory per GPU: not given by this torch (see the notes); the verdict is not "
                      "checked[/]")  # fmt: skip
    else:
        _render_memory(report, console)
    _render_speed(report, console)
    if p.pipeline_ranks:
        _render_pipeline(report, console)
    for note in p.notes:
        console.print(f"note: {note}", highlight=False)


def _render_memory(report: PlanReport, console: Console) -> None:
    p, gpu = report.plan, report.gpu
    memory = Table(title="memory per GPU at the step's peak (exact for the traced step)", title_justify="left")
    memory.add_column("category")
    memory.add_column("GiB", justify="right")
    for name, size in p.memory.items():
        if size or name != "other":
            memory.add_row(name, f"{size / GIB:.2f}")
    verdict = "[green]fits[/]" if report.fits else f"[red]does not fit: {report.shortfall_gib:.2f} GiB over[/]"
    memory.add_row("[bold]peak[/]", f"[bold]{p.peak_bytes / GIB:.2f}[/]")
    memory.add_row(f"budget ({gpu.memory_gib:g} GiB less {report.headroom:.0%} headroom)",
                   f"{report.budget_bytes / GIB:.2f}  {verdict}")  # fmt: skip
    console.print(memory)


def _render_speed(report: PlanReport, console: Console) -> None:
    p, gpu = report.plan, report.gpu
    speed = Table(title=f"speed per GPU (estimates: roofline on {gpu.name} peak figures)", title_justify="left")
    speed.add_column("figure")
    speed.add_column("value", justify="right")
    speed.add_row("FLOPs per step (lmforge's counter)", f"{p.flops:.4g}")
    speed.add_row("  of which 6 x N x tokens", f"{p.dense_flops:.4g}")
    if p.optimizer_flops:
        speed.add_row("optimizer update FLOPs (not in MFU)", f"{p.optimizer_flops:.4g}")
    speed.add_row("compute time (roofline)", f"{p.compute_seconds * 1e3:.1f} ms")
    speed.add_row("collective time (not overlapped)", f"{p.comm_seconds * 1e3:.1f} ms")
    if p.in_line_seconds:
        speed.add_row("  of which tensor-parallel (in line)", f"{p.in_line_seconds * 1e3:.1f} ms")
    overlap = "collectives overlapped" + (", tensor-parallel ones added" if p.in_line_seconds else "")
    speed.add_row(f"step time ({overlap})", f"{p.step_seconds * 1e3:.1f} ms")
    speed.add_row("tokens/s per GPU", f"{report.tokens_per_s:,.0f}")
    speed.add_row("MFU", f"{report.mfu:.1%}")
    console.print(speed)

    if p.comms:
        comms = Table(title="collectives per step on this GPU", title_justify="left")
        for col in ("kind", "calls", "buffers GiB", "sent GiB", "ms"):
            comms.add_column(col, justify="left" if col == "kind" else "right")
        for kind, t in sorted(p.comms.items()):
            comms.add_row(kind, str(t.calls), f"{t.buffer_bytes / GIB:.3f}", f"{t.sent_bytes / GIB:.3f}",
                          f"{t.seconds * 1e3:.1f}")  # fmt: skip
        console.print(comms)


def _render_pipeline(report: PlanReport, console: Console) -> None:
    """Every pipeline rank's peak and times: the tables above are the rank with the highest peak."""
    p = report.plan
    table = Table(title=f"pipeline ranks (the tables above: the highest peak; {p.bubble:.1%} of each step idle in "
                  "theory)", title_justify="left")  # fmt: skip
    for col in ("rank", "stages", "peak GiB", "busy ms", "step ms"):
        table.add_column(col, justify="left" if col == "stages" else "right")
    for rank in p.pipeline_ranks:
        table.add_row(str(rank["pipeline_rank"]), rank["layers"],
                      f"{rank['peak_bytes'] / GIB:.2f}", f"{rank['busy_seconds'] * 1e3:.1f}",
                      f"{rank['step_seconds'] * 1e3:.1f}")  # fmt: skip
    console.print(table)
