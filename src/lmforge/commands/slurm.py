"""`lmforge slurm [@ FILE.toml ...] [--section.field VALUE ...]` (also `sft --slurm ...`): train as a Slurm job.

The config is resolved and checked exactly as `lmforge train` does, for the world size of `[deployment]`, before
anything is written or submitted. Then the resolved config goes to `<output_dir>/config.toml`, the job script
rendered from the sbatch template to `<output_dir>/slurm/job.sbatch`, and `sbatch` submits it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.commands.errors import BAD_INPUT, fail

if TYPE_CHECKING:
    from lmforge.config.train import TrainConfig

USAGE = """\
usage: lmforge slurm [@ FILE.toml ...] [--section.field VALUE ...] [--overwrite]
                     [--dry-run] [--no-submit] [--no-plan] [--plan-gpu NAME] [--print-template] [--help]

Resolve and check the training config for [deployment] num_nodes x procs_per_node processes, write it and an sbatch
script (from the [slurm] section) into the run directory, and submit the script with sbatch. A GPU job (one that
sets slurm.gpus_per_node) is planned first (`lmforge plan`, docs/plan.md): a config whose step does not fit in GPU
memory is neither written nor submitted.

  --dry-run         print the job script; write and submit nothing
  --no-submit       write the config and the script, but do not submit
  --overwrite       start a used output_dir over (its metrics and checkpoints are deleted now, at submission)
  --no-plan         submit a GPU job without planning it first
  --plan-gpu NAME   the GPU the plan checks against: h100 (default), h200, a100, a100-40gb, b200
  --print-template  print the built-in sbatch template (a start for slurm.template_path)

Every config field is listed by `lmforge train --help`; [deployment] and [slurm] by `lmforge train --help slurm`
and `--help deployment`."""


def _flag(argv: list[str], name: str) -> bool:
    present = name in argv
    while name in argv:
        argv.remove(name)
    return present


def _value(argv: list[str], name: str, default: str) -> str:
    if name not in argv:
        return default
    at = argv.index(name)
    if at + 1 == len(argv):
        raise ValueError(f"{name} needs a value")
    value = argv[at + 1]
    del argv[at : at + 2]
    return value


def main(argv: list[str], command: str = "slurm") -> int:
    """Check the config, write the job, submit it; returns the exit code (2 for bad input or a refused job).
    `command` names the command in messages (`train` for `lmforge train --slurm`)."""
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from lmforge.launch.sbatch import JobFiles, LaunchError, builtin_template, render_script

    if _flag(argv, "--print-template"):
        print(builtin_template(), end="")
        return 0
    no_submit = _flag(argv, "--no-submit")
    overwrite = _flag(argv, "--overwrite")
    no_plan = _flag(argv, "--no-plan")
    try:
        plan_gpu = _value(argv, "--plan-gpu", "h100")
    except ValueError as e:
        return fail(command, str(e))

    from lmforge.checkpoint.layout import CheckpointError
    from lmforge.checkpoint.run_dir import prepare_output_dir
    from lmforge.config import ConfigError, load_train_config

    try:
        config, raw = load_train_config(argv, world_size=None)
        files = JobFiles(Path(config.output_dir).resolve())
        script = render_script(config, files, Path.cwd())
        if not no_plan and config.slurm.gpus_per_node is not None and not _fits(config, plan_gpu, command):
            return BAD_INPUT
        if raw.dry_run:
            print(script, end="")
            return 0
        prepare_output_dir(config, overwrite)
        files.logs.mkdir(parents=True, exist_ok=True)
        files.script.parent.mkdir(parents=True, exist_ok=True)
        files.script.write_text(script, encoding="utf-8")
        os.chmod(files.script, 0o755)
        if no_submit:
            print(f"lmforge {command}: wrote {files.script} and {files.config}; submit with: sbatch {files.script}")
            return 0
        from lmforge.launch.submit import submit

        job_id = submit(files.script)
    except (ConfigError, CheckpointError, LaunchError) as e:
        return fail(command, str(e))
    deploy = config.deployment
    shape = f"{deploy.num_nodes} node(s) x {deploy.procs_per_node} process(es)"
    print(f"lmforge {command}: submitted job {job_id}: {shape}")
    print(f"  script:  {files.script}")
    print(f"  config:  {files.config}")
    print(f"  job log: {files.job_log(job_id)}")
    print(f"  nodes:   {files.logs}/node_<i>.log (ranks: {files.logs}/rank_<k>.log)")
    # torchrun numbers the ranks in the order the nodes join, so the rank that prints the steps may be on any node
    nodes = " ".join(str(files.node_log(i)) for i in range(min(deploy.num_nodes, 8)))
    print(f"  follow:  tail -F {files.job_log(job_id)} {nodes}")
    return 0


def _fits(config: TrainConfig, gpu_name: str, command: str) -> bool:
    """Plan the job's step on its [deployment] world (printing the report); False, with the reason on stderr, when
    it does not fit or cannot be planned."""
    from lmforge.commands.plan import plan_and_report
    from lmforge.plan.gpus import gpu_spec
    from lmforge.plan.report import DEFAULT_HEADROOM

    deploy = config.deployment
    try:
        gpu = gpu_spec(gpu_name)
        result = plan_and_report(config, deploy.num_nodes * deploy.procs_per_node, deploy.procs_per_node, gpu,
                                 DEFAULT_HEADROOM, command=command)  # fmt: skip
    except ValueError as e:
        fail(command, f"{e} (--no-plan submits without a plan)")
        return False
    if not result["fits"]:
        fail(command, "the job was not submitted: its step does not fit in GPU memory (--no-plan submits anyway)")
        return False
    return True
