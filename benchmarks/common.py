"""What the benchmark scripts share: model and training settings, the lmforge config built from them, the common
command-line flags, running a side in a child process, timed steps, small data fixtures and the result tables.

Each script keeps what is its own (its sides, its figures, its report); this module holds only code that two or
more of them would otherwise repeat. Scripts import it by its bare name: running `benchmarks/NAME.py` puts the
`benchmarks/` folder first on `sys.path`, and spawned children inherit that path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from cpu_load import ForeignLoad
from lmforge.config import FakeDataConfig, TrainConfig
from lmforge.config.arch import LlamaArch
from lmforge.train.host_memory import ENV_SETTING, SWITCH

T = TypeVar("T")

EOS = "<|endoftext|>"
"""End-of-document token of the word-level tokenizers the scripts write (id 0)."""


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ModelSettings:
    """A Llama's shape, vocabulary and init; the defaults are the d256 x 6 model the CPU benchmarks train."""

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    """None: one key/value head per query head."""
    vocab_size: int = 512
    seq_len: int = 512
    """Tokens per window; also the model's `max_position_embeddings`."""
    init_std: float = 0.02
    init_seed: int = 0

    def llama_arch(self) -> LlamaArch:
        """The Llama architecture of these settings."""
        return LlamaArch(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.seq_len,
        )

    def model_section(self, init: Mapping[str, Any] | None = None, **options: Any) -> dict[str, Any]:
        """The `[model]` table of an lmforge config: the architecture, the init (plus `init`'s entries) and
        `options` (attn, param_dtype, compile...)."""
        return {
            "arch": self.llama_arch().model_dump(),
            "init": {"std": self.init_std, "seed": self.init_seed, **(init or {})},
            **options,
        }


@dataclass(frozen=True)
class TrainSettings(ModelSettings):
    """A model trained on fake data: the batch geometry, the optimizer and the step counts on top of the model."""

    batch_tokens: int = 4096
    micro_batch_tokens: int = 1024
    mean_doc_len: float = 256.0
    data_seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 2
    """Untimed steps first."""
    steps: int = 10
    """Timed steps."""

    def fake_data(self) -> FakeDataConfig:
        """lmforge's fake data of this geometry: uniform random tokens, geometric document lengths, masking on."""
        return FakeDataConfig(
            seq_len=self.seq_len,
            batch_tokens=self.batch_tokens,
            micro_batch_tokens=self.micro_batch_tokens,
            vocab_size=self.vocab_size,
            mean_doc_len=self.mean_doc_len,
            pattern="uniform",
            document_masking=True,
            seed=self.data_seed,
        )

    def train_config(
        self,
        output_dir: str,
        model: Mapping[str, Any] | None = None,
        optim: Mapping[str, Any] | None = None,
        **sections: Any,
    ) -> TrainConfig:
        """The lmforge config of warmup + timed steps at a constant lr (no schedule: a timed step must not depend
        on where it falls in the run). `model` and `optim` add to those tables; `sections` are further tables."""
        return TrainConfig.model_validate(
            {
                "max_steps": self.warmup + self.steps,
                "output_dir": output_dir,
                "model": self.model_section(**(model or {})),
                "data": self.fake_data().model_dump(),
                "optim": {"type": "adamw", "lr": self.lr, "weight_decay": self.weight_decay, **(optim or {})},
                "schedule": {"warmup": 0.0, "decay": 0.0},
                **sections,
            }
        )


TINY_MODEL = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4}
"""The model of the smoke runs: d64 x 2, 4 heads."""
TINY_BATCH = {"seq_len": 128, "batch_tokens": 256, "micro_batch_tokens": 128, "mean_doc_len": 32.0}
"""The batch of the smoke runs that train: 2 windows of 128 tokens a step, documents of 32 tokens on average."""
SHORT_RUN = {"warmup": 1, "steps": 2, "repeats": 1}
"""The step counts of the smoke runs."""


def tiny(settings_type: type[T], **changes: Any) -> T:
    """The settings of a smoke run (`--smoke`: a check that the script runs, in seconds, not a figure): a
    `settings_type` dataclass with the `TINY_MODEL`, the `TINY_BATCH` if it is a `TrainSettings`, the `SHORT_RUN`
    step counts it has fields for, then `changes` (what the script needs smaller or different)."""
    names = {f.name for f in fields(settings_type)}  # type: ignore[arg-type]
    batch = TINY_BATCH if issubclass(settings_type, TrainSettings) else {}
    run = {k: v for k, v in SHORT_RUN.items() if k in names}
    return settings_type(**{**TINY_MODEL, **batch, **run, **changes})


# ---------------------------------------------------------------------------------------------- flags


FLAG_HELP = {
    "steps": "timed steps per run",
    "warmup": "untimed steps first",
    "repeats": "times each measurement is repeated",
    "threads": "torch threads",
}
"""What each common flag sets; `benchmark_parser` adds the defaults of every preset."""


def _defaults(name: str, presets: Mapping[str, Any]) -> str:
    """`default 10; smoke 2`: the value of field `name` in the first preset, then in the others where it differs."""
    values = [(label, getattr(preset, name)) for label, preset in presets.items()]
    default = values[0][1]
    return "; ".join([f"default {default}", *(f"{label} {v}" for label, v in values[1:] if v != default)])


def benchmark_parser(
    doc: str,
    presets: Mapping[str, Any],
    smoke: str,
    quiet_wait: str | None = None,
    all_cores: bool = False,
    skip: Collection[str] = (),
    texts: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The parser of a benchmark script, described by the first paragraph of its docstring, with the common flags.

    `presets` are the script's settings (dataclasses) by name, the default first ("default", then e.g. "cuda",
    "smoke"). A flag is added for each of `steps`, `warmup`, `repeats` and `threads` that the default preset has
    as a field and `skip` does not name, its help naming each preset's value, so the help cannot drift from the
    presets; `texts` replaces the words of `FLAG_HELP` where a script means something else. Unset, a flag stays None
    and `with_flags` leaves the chosen preset alone; with `all_cores`, `--threads` defaults to every core.
    `--quiet-wait` is added where `quiet_wait` says when it waits ("before each run"); `--smoke` and `--json`
    always are. Help texts keep their line breaks.
    """
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    offered = {f.name for f in fields(next(iter(presets.values())))} - set(skip)
    for name, text in {**FLAG_HELP, **(texts or {})}.items():
        if name not in offered:
            continue
        if name == "threads" and all_cores:
            p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help=f"{text} (default: all cores)")
        else:
            p.add_argument(f"--{name}", type=int, default=None, help=f"{text} ({_defaults(name, presets)})")
    if quiet_wait is not None:
        p.add_argument(
            "--quiet-wait",
            type=float,
            default=None,
            help=f"{quiet_wait}, wait up to this many seconds for other processes to leave the CPUs\n"
            "(default 60; smoke 0: don't wait)",
        )
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    return p


def with_flags(settings: T, args: argparse.Namespace) -> T:
    """`settings` (a dataclass) with the steps, warmup, repeats and threads the command line set, where it has them."""
    names = {"steps", "warmup", "repeats", "threads"} & {f.name for f in fields(settings)}  # type: ignore[arg-type]
    changes = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return replace(settings, **changes)  # type: ignore[type-var]


def quiet_wait_s(args: argparse.Namespace) -> float:
    """`--quiet-wait`, or its default: 60 s, but 0 for a smoke run (a check that the script runs, not a figure)."""
    return args.quiet_wait if args.quiet_wait is not None else (0.0 if args.smoke else 60.0)


# ---------------------------------------------------------------------------------------------- running sides


ALLOCATORS: dict[str, dict[str, str]] = {"lmforge": ENV_SETTING, "default": {SWITCH: "0"}}
"""The allocator settings a benchmark gives every side it compares, as environment variables: lmforge's (glibc's
mmap and trim thresholds, which lmforge then leaves as they are) and glibc's defaults (lmforge told not to change
them). glibc's settings change a CPU step's time by 20-28% on small machines, so every side gets the same one."""
ALLOCATOR_LABELS = {"lmforge": "lmforge's malloc setting for every side", "default": "glibc's defaults for every side"}


def allocator_names(value: str) -> list[str]:
    """The allocator settings named in a comma-separated flag value; ValueError for an unknown one."""
    names = [a for a in value.split(",") if a]
    if not names or any(a not in ALLOCATORS for a in names):
        raise ValueError(f"allocator settings are {', '.join(ALLOCATORS)}; got {value!r}")
    return names


def in_turn(sides: Sequence[T], repeat: int) -> Sequence[T]:
    """`sides` in order on even repeats and reversed on odd ones, so drift in the machine's speed favours none."""
    return sides if repeat % 2 == 0 else sides[::-1]


def _child(target: Callable[..., dict[str, Any]], args: tuple[Any, ...], conn: Connection) -> None:
    """Entry point of a spawned child: send back what `target(*args)` returns, or the error that stopped it."""
    try:
        conn.send(target(*args))
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}".splitlines()[0][:300], "traceback": traceback.format_exc()})
    finally:
        conn.close()


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set `env` in this process's environment for the duration, then restore what was there."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_in_child(
    target: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
    name: str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Call `target(*args)` in a fresh spawned interpreter and return the dict it returns.

    A side measured in a process of its own has its own peak memory and allocator history, and a crash or an out-
    of-memory cannot take the other sides down. `env` is added to the child's environment (a spawned interpreter
    inherits the environment at start). Failures come back as a dict with `error` (one line) and, where the child
    could say, `traceback`: an exception, a child that died without a result, or one still running after `timeout`
    seconds (then killed). `target` must be a module-level function, so that the child can import it.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(target, args, child), name=name)
    with _environment(env):
        proc.start()
    child.close()  # else the parent's copy keeps the pipe open and a dead child would never read as EOF
    result: dict[str, Any] | None = None
    if parent.poll(timeout):
        # EOFError: the child died without a word (a crash); its exit code, below, says more.
        with contextlib.suppress(EOFError):
            result = parent.recv()
        proc.join(timeout=30)  # after sending, a child only closes its trainer and process group
    else:
        result = {"error": f"timed out after {timeout:.0f} s"}
    if proc.is_alive():
        proc.kill()
        proc.join()
    return result if result is not None else {"error": f"the process exited with code {proc.exitcode} without a result"}


def raise_for_error(result: dict[str, Any], what: str) -> dict[str, Any]:
    """`result` of `run_in_child`, or a RuntimeError with the child's traceback when `what` failed."""
    if "error" in result:
        raise RuntimeError(f"{what} failed:\n{result.get('traceback', result['error'])}")
    return result


# ---------------------------------------------------------------------------------------------- timing


def sync(device: torch.device | None) -> None:
    """Wait for queued device work, so wall time covers it (nothing to wait for on the CPU)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Steps(Generic[T]):
    """What `timed_steps` measured."""

    results: list[T]
    """What each step returned, warmup included."""
    seconds: list[float]
    """Wall time of each timed step."""
    ends: list[float]
    """`time.perf_counter()` at the end of each timed step."""
    timed_from: float
    """`time.perf_counter()` when the timed steps began."""
    foreign_cores: float
    """Mean cores other processes kept busy during the timed steps: torch's thread pool is sized to the machine,
    so foreign load stalls its barriers and can slow a step many times over."""


def timed_steps(warmup: int, steps: int, step: Callable[[int], T], device: torch.device | None = None) -> Steps[T]:
    """Call `step(i)` for warmup + steps values of i; time the last `steps` calls, the device synchronized around
    each so that the time covers the step's device work."""
    results: list[T] = []
    seconds: list[float] = []
    ends: list[float] = []
    load = ForeignLoad()
    timed_from = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            load.start()
            timed_from = time.perf_counter()
        sync(device)
        t0 = time.perf_counter()
        results.append(step(i))
        sync(device)
        t1 = time.perf_counter()
        if i >= warmup:
            seconds.append(t1 - t0)
            ends.append(t1)
    return Steps(results, seconds, ends, timed_from, load.cores(sum(seconds)))


# ---------------------------------------------------------------------------------------------- data fixtures


def write_word_tokenizer(folder: Path, size: int) -> Path:
    """A word-level tokenizer folder: EOS at id 0, then the words w1 .. w{size-1}, one token each, so a text of
    words maps to known ids and any id array can be written as a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS: 0, **{f"w{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}), encoding="utf-8")
    return folder


def write_shard_index(path: Path, ends: np.ndarray, tokenizer: str) -> None:
    """The two files that go with a uint16 token shard `path` (`NAME.ds`) in datatrove's layout (docs/data.md):
    `NAME.ds.index`, the uint64 END offset of every document, and `NAME.ds.metadata`, `tokenizer|2` (2 bytes a
    token) and then the token count, which is the last end."""
    ends = np.asarray(ends).astype("<u8")
    ends.tofile(path.with_name(path.name + ".index"))
    path.with_name(path.name + ".metadata").write_text(f"{tokenizer}|2\n{int(ends[-1])}\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------- report


def make_console(width: int = 120) -> Console:
    """A console for the report: the terminal's width, or `width` in logs and pipes (so that tables don't wrap)."""
    return Console(width=None if sys.stdout.isatty() else width)


def result_table(title: str, columns: Sequence[str], left: Collection[str] | None = None) -> Table:
    """A table of results: the columns named in `left` (default: the first) hold labels and are left-aligned, the
    others hold figures and are right-aligned."""
    labels = columns[:1] if left is None else left
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in labels else "right")
    return table


def verdict(ok: bool) -> str:
    """A target's verdict, in rich markup."""
    return "[green]PASS[/]" if ok else "[red]MISS[/]"


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    """Write the figures to `path` (`--json`; nothing when None) as indented JSON, creating the folder; NaN is
    allowed (a diverged run's loss)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2, allow_nan=True) + "\n", encoding="utf-8")
