"""`lmforge tokenize INPUT ... --tokenizer DIR --output DIR [--holdout F --holdout-output DIR] [--slurm ...]`.

The work is `lmforge.prep.tokenize` (on this machine) or `lmforge.prep.tokenize_slurm` (`--slurm`: the same
pipeline as Slurm array jobs); this module turns flags into their arguments, prints a summary line per output
folder, and reports bad input as one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.config.launch import SlurmConfig
from lmforge.config.loader import ConfigError
from lmforge.data.tokenizer import TokenizerError
from lmforge.prep.text_sources import SourceError
from lmforge.prep.tokenize import (
    ShardSummary,
    TokenizeJob,
    TokenizePlan,
    clear_outputs,
    plan_tokenize,
    summary_line,
    tokenize_corpus,
)

SLURM_FLAGS = ("partition", "time", "account", "qos", "constraint", "cpus_per_task", "mem", "job_name")
"""`[slurm]` fields that `lmforge tokenize --slurm` also takes as flags (`--cpus-per-task` for cpus_per_task)."""


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge tokenize",
        description="Tokenize local text into datatrove token shards (.ds, .ds.index, .ds.metadata).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="text files, folders of them, .jsonl or .parquet files")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder or tokenizer.json")
    parser.add_argument("--output", type=Path, required=True, help="folder for the token shards")
    parser.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--tasks", type=int, default=1, help="datatrove tasks, each writes its own files")
    parser.add_argument("--workers", type=int, default=None, help="tasks run at once (default min(tasks, CPUs))")
    parser.add_argument("--max-tokens-per-file", type=int, default=None, help="split a task's output into files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document shuffle and the holdout draw")
    parser.add_argument("--holdout", type=float, default=None, help="fraction of documents to hold out, in (0, 1)")
    parser.add_argument("--holdout-output", type=Path, default=None, help="folder for the holdout shards")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards in existing output folders")
    slurm = parser.add_argument_group("Slurm", "run the tasks as a Slurm array job per output folder")
    slurm.add_argument("--slurm", action="store_true", help="submit the tokenizing to Slurm instead of running it here")
    slurm.add_argument("--slurm-config", type=Path, default=None, help="TOML file whose [slurm] table sets the job")
    for name in SLURM_FLAGS:
        slurm.add_argument(f"--{name.replace('_', '-')}", dest=f"slurm_{name}", default=None, help=f"slurm.{name}")
    slurm.add_argument("--wait", action="store_true", help="wait for the jobs to end, then print the summary")
    slurm.add_argument("--wait-timeout", type=float, default=86400.0, help="seconds --wait waits at most")
    return parser


def _slurm_config(args: argparse.Namespace) -> SlurmConfig:
    """The [slurm] table of --slurm-config, with the flags on top, validated like a training config's."""
    from lmforge.config.loader import RawConfig, read_toml, validate

    raw = RawConfig()
    if args.slurm_config is not None:
        table = read_toml(args.slurm_config).get("slurm", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{args.slurm_config}: [slurm] must be a table")
        raw.values.update(table)
        raw.sources.update({name: str(args.slurm_config) for name in table})
    for name in SLURM_FLAGS:
        value = getattr(args, f"slurm_{name}")
        if value is not None:
            raw.values[name] = int(value) if name == "cpus_per_task" and value.isdigit() else value
            raw.sources[name] = "the command line"
    config = validate(SlurmConfig, raw)
    assert isinstance(config, SlurmConfig)
    return config


def _print_summary(results: list[tuple[TokenizeJob, ShardSummary]]) -> None:
    for job, s in results:
        print(summary_line(job.label, s, job.output))
        if s.documents == 0:
            print(f"warning: {job.label} got no documents", file=sys.stderr)


def _run_on_slurm(args: argparse.Namespace, plan: TokenizePlan, slurm: SlurmConfig) -> int:
    from lmforge.launch.sbatch import LaunchError
    from lmforge.prep.tokenize_slurm import submit_tokenize, wait_tokenize

    try:
        submitted = submit_tokenize(plan, slurm)
    except LaunchError as e:
        clear_outputs(plan)
        return fail("tokenize", str(e))
    for sub in submitted:
        print(f"{sub.job.label}: submitted Slurm job {sub.job_id} ({sub.tasks} tasks) -> {sub.job.output}")
        print(f"  logs: {sub.slurm_logs}")
    if not args.wait:
        return 0
    try:
        _print_summary(wait_tokenize(submitted, args.wait_timeout))
    except (LaunchError, SourceError) as e:
        return fail("tokenize", str(e))
    return 0


def main(argv: list[str]) -> int:
    """Run `lmforge tokenize` with the arguments after `tokenize`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    if not args.slurm:
        given = [f"--{n.replace('_', '-')}" for n in SLURM_FLAGS if getattr(args, f"slurm_{n}") is not None]
        if given or args.slurm_config is not None or args.wait:
            return fail("tokenize", f"{(given or ['--slurm-config/--wait'])[0]} needs --slurm")
    try:
        slurm = _slurm_config(args) if args.slurm else None
        plan = plan_tokenize(
            args.inputs,
            args.tokenizer,
            args.output,
            text_key=args.text_key,
            tasks=args.tasks,
            workers=args.workers,
            max_tokens_per_file=args.max_tokens_per_file,
            seed=args.seed,
            holdout=args.holdout,
            holdout_output=args.holdout_output,
            overwrite=args.overwrite,
        )
        if slurm is not None:
            return _run_on_slurm(args, plan, slurm)
        results = tokenize_corpus(plan)
    except (ConfigError, SourceError, TokenizerError) as e:
        return fail("tokenize", str(e))
    _print_summary(results)
    return 0
