"""`lmforge train [@ FILE.toml ...] [--section.field VALUE ...]` (also `sft`): validate the config, then train.

With `--slurm` the run is submitted as a Slurm job instead (`lmforge slurm`).

`--help` lists every config field with its default and meaning; `--help SECTION` (e.g. `--help data`) one section.
"""

from __future__ import annotations

import os
import sys
import traceback

from lmforge.commands.errors import fail

LOST_RANK = 1
"""The exit code of a rank that lost the others (their process died or hung): not bad input, a failed run."""


def _help(argv: list[str]) -> int:
    from lmforge.config.help import train_help

    at = next(i for i, a in enumerate(argv) if a in ("-h", "--help"))
    section = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
    try:
        print(train_help(section))
    except ValueError as e:
        return fail("train", str(e))
    return 0


def _slurm_switch(argv: list[str]) -> int | None:
    # A bare `--slurm` submits the run; `--slurm VALUE` is a (bad) value for the [slurm] section, reported as such.
    for i, arg in enumerate(argv):
        if arg == "--slurm" and (i + 1 == len(argv) or argv[i + 1].startswith(("--", "@"))):
            return i
    return None


def main(argv: list[str]) -> int:
    """Validate the config, then train on this process's rank; returns the exit code."""
    switch = _slurm_switch(argv)
    if switch is not None:  # `sft --slurm ...`: the same run, submitted as a Slurm job
        from lmforge.commands import slurm

        return slurm.main(argv[:switch] + argv[switch + 1 :], command="train")
    if any(a in ("-h", "--help") for a in argv):
        return _help(argv)
    from lmforge.config import ConfigError, dump_toml, load_train_config
    from lmforge.launch.torchrun import env_world_size

    overwrite = "--overwrite" in argv
    argv = [a for a in argv if a != "--overwrite"]
    try:
        config, raw = load_train_config(argv, env_world_size())
    except ConfigError as e:
        return fail("train", str(e))
    if raw.dry_run:
        print(dump_toml(config), end="")
        return 0

    from lmforge.checkpoint.layout import CheckpointError
    from lmforge.checkpoint.run_dir import prepare_run
    from lmforge.config.hf_config import HFModelError
    from lmforge.data.stream import DataError
    from lmforge.eval.sets import EvalSetError
    from lmforge.monitor.base import RecordError
    from lmforge.parallel.heartbeat import Heartbeat, describe_lost
    from lmforge.parallel.process_group import init_distributed, mesh_degrees, shutdown_distributed
    from lmforge.train.trainer import Trainer

    timeout = config.parallel.timeout_s
    ctx = init_distributed(timeout_minutes=timeout / 60, **mesh_degrees(config.parallel))
    heartbeat = Heartbeat(ctx.rank, ctx.world_size, min(2.0, timeout / 10)) if ctx.world_size > 1 else None
    try:
        try:
            resume_from = prepare_run(config, overwrite)
            trainer = Trainer(config, ctx, resume_from=resume_from)
        except (ConfigError, CheckpointError, HFModelError, EvalSetError, RecordError, *DataError) as e:
            return fail("train", str(e))
        if resume_from is not None and trainer.step >= config.max_steps:
            # A finished run resumed: say so instead of exiting silently.
            trainer.close()
            if ctx.is_main:
                print(
                    f"lmforge train: {resume_from} is at step {trainer.step}, and max_steps is {config.max_steps}: "
                    "nothing left to train (raise max_steps to train on)"
                )
            return 0
        try:
            trainer.train()
        except (CheckpointError, RecordError) as e:  # a failed save or record (a full disk): one line, exit 2
            return fail("train", str(e))
        except Exception as e:
            if heartbeat is None:
                raise
            silent = heartbeat.silent_ranks()
            if silent == []:  # every rank still beats: this rank failed itself
                # Leave at once, without the barrier of an orderly exit: peers waiting on this rank in a collective
                # or a pipeline receive then see it gone and stop, instead of waiting out the process-group timeout.
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                heartbeat.stop()
                os._exit(1)
            # Every surviving rank says it (the first rank may be the lost one). The process group cannot be left
            # cleanly with a rank missing (its barrier would wait out the timeout again), so the process ends here.
            print(f"lmforge train: error: {describe_lost(ctx.rank, silent, e)}", file=sys.stderr, flush=True)
            os._exit(LOST_RANK)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        shutdown_distributed()
    return 0
