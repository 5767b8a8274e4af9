"""`lmforge train [@ FILE.toml ...] [--section.field VALUE ...]` (also `sft`): validate the config, then train.

`--help` lists every config field with its default and meaning; `--help SECTION` (e.g. `--help data`) one section.
"""

from __future__ import annotations

from lmforge.commands.errors import fail


def _help(argv: list[str]) -> int:
    from lmforge.config.help import train_help

    at = next(i for i, a in enumerate(argv) if a in ("-h", "--help"))
    section = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
    try:
        print(train_help(section))
    except ValueError as e:
        return fail("train", str(e))
    return 0


def main(argv: list[str]) -> int:
    """Validate the config, then train on this process's rank; returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        return _help(argv)
    from lmforge.config import ConfigError, dump_toml, load_train_config
    from lmforge.parallel import env_world_size

    overwrite = "--overwrite" in argv
    argv = [a for a in argv if a != "--overwrite"]
    try:
        config, raw = load_train_config(argv, env_world_size())
    except ConfigError as e:
        return fail("train", str(e))
    if raw.dry_run:
        print(dump_toml(config), end="")
        return 0

    from lmforge.data import DataError
    from lmforge.eval.sets import EvalSetError
    from lmforge.model.hf_config import HFModelError
    from lmforge.parallel import init_distributed, shutdown_distributed
    from lmforge.runtime.checkpoint import CheckpointError
    from lmforge.runtime.run_dir import prepare_run
    from lmforge.train.trainer import Trainer

    ctx = init_distributed()
    try:
        try:
            resume_from = prepare_run(config, overwrite)
            trainer = Trainer(config, ctx, resume_from=resume_from)
        except (ConfigError, CheckpointError, HFModelError, EvalSetError, *DataError) as e:
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
        trainer.train()
    finally:
        shutdown_distributed()
    return 0
