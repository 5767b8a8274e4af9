"""`[deployment]`, `[slurm]` and the sbatch script `lmforge slurm` renders, without a Slurm cluster."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from lmforge.cli import main as cli_main
from lmforge.config import ConfigError, load_train_config
from lmforge.launch.sbatch import JobFiles, LaunchError, render_script
from tests.integration.runner import write_config


def _config(tmp_path: Path, *flags: str):
    return load_train_config(["@", str(write_config(tmp_path, "run")), *flags], world_size=None)[0]


def _render(tmp_path: Path, *flags: str) -> str:
    config = _config(tmp_path, *flags)
    return render_script(config, JobFiles(Path(config.output_dir)), tmp_path)


def test_script_for_four_nodes_of_eight_gpus(tmp_path: Path) -> None:
    script = _render(
        tmp_path,
        *("--deployment.num-nodes", "4", "--deployment.procs-per-node", "8", "--deployment.rdzv-port", "29123"),
        *("--data.batch-tokens", "4096", "--slurm.gpus-per-node", "8", "--slurm.partition", "h100"),
        *("--slurm.time", "2-00:00:00", "--slurm.requeue", "--slurm.signal-before-s", "300", "--slurm.exclusive"),
        *("--slurm.account", "llm", "--slurm.cpus-per-task", "96", "--slurm.extra-sbatch", '["--mail-type=END"]'),
        *("--slurm.env", '{NCCL_SOCKET_IFNAME = "ib0", NCCL_DEBUG = "INFO"}', "--slurm.setup", '["module load cuda"]'),
    )
    run_dir = tmp_path / "run"
    lines = script.splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=run",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --chdir={tmp_path}",
        f"#SBATCH --output={run_dir}/logs/slurm_%j.log",
        "#SBATCH --open-mode=append",
        "#SBATCH --partition=h100",
        "#SBATCH --account=llm",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --exclusive",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=96",
        "#SBATCH --signal=B:TERM@300",
        "#SBATCH --requeue",
        "#SBATCH --mail-type=END",
    ]
    # sbatch reads directives only before the first command: the setup line comes after all of them
    first_command = next(i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#"))
    assert lines[first_command] == "module load cuda"
    assert "export OMP_NUM_THREADS=12" in lines  # 96 CPUs / 8 processes
    assert "export NCCL_SOCKET_IFNAME=ib0" in lines
    assert "export NCCL_DEBUG=INFO" in lines and "export NCCL_DEBUG=WARN" not in lines  # slurm.env wins
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in lines
    assert re.search(r"^srun --nodes=4 --ntasks-per-node=1 --cpus-per-task=96 --kill-on-bad-exit=1", script, re.M)
    assert '--output="$RUN_DIR/logs/node_%n.log"' in script
    assert "-m torch.distributed.run --nnodes=4 --nproc-per-node=8" in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:29123" --rdzv-id="$SLURM_JOB_ID"' in script
    assert 'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert f"-m lmforge train @ {run_dir}/config.toml" in script
    # the stop signal goes to the training processes of every node, and a stopped, unfinished run requeues itself
    assert "trap stop_training TERM" in script
    assert "srun --overlap --nodes=4 --ntasks-per-node=1" in script
    assert "pkill -TERM -P" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "LATEST < 6 " in script  # max_steps of the config
    assert 'RESUME=(--resume.step auto --resume.path "$RUN_DIR")' in script


def test_script_without_requeue_or_signal(tmp_path: Path) -> None:
    script = _render(tmp_path, "--slurm.signal-before-s", "0")
    assert "#SBATCH --signal" not in script
    assert "#SBATCH --no-requeue" in script
    assert "scontrol requeue" not in script
    assert "--partition" not in script and "--gpus-per-node" not in script
    assert "export OMP_NUM_THREADS=1" in script.splitlines()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--slurm.partion", "gpu"],
            "slurm.partion (from the command line): unknown field (known fields here: job_name",
        ),
        (["--slurm.time", "2 days"], "slurm.time (from the command line): Value error, '2 days' is not a Slurm time"),
        (["--slurm.mem", "lots"], "slurm.mem (from the command line): Value error, 'lots' is not a Slurm memory size"),
        (["--slurm.env", '{"BAD-NAME" = "1"}'], "'BAD-NAME' is not an environment variable name"),
        (["--slurm.extra-sbatch", '["mail-type=END"]'], "'mail-type=END' is not an sbatch option"),
        (["--slurm.job-name", "a\nb"], "slurm.job_name (from the command line): Value error, must be one line"),
        (["--deployment.num-nodes", "0"], "deployment.num_nodes (from the command line): Input should be greater"),
        (["--deployment.rdzv-port", "70000"], "deployment.rdzv_port (from the command line): Input should be less"),
    ],
)
def test_bad_launch_fields(tmp_path: Path, flags: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, *flags)
    assert expected in str(err.value)


def test_world_size_comes_from_the_deployment(tmp_path: Path) -> None:
    # batch_tokens 1024 = 128 x 8: fine for 8 processes, not for 3 nodes x 2
    _config(tmp_path, "--deployment.num-nodes", "4", "--deployment.procs-per-node", "2")
    with pytest.raises(ConfigError, match=r"data.batch_tokens .*micro_batch_tokens x world size \(128 x 6 = 768\)"):
        _config(tmp_path, "--deployment.num-nodes", "3", "--deployment.procs-per-node", "2")


def test_extra_sbatch_lines_are_normalized(tmp_path: Path) -> None:
    config = _config(tmp_path, "--slurm.extra-sbatch", '["--mail-type=END", "  #SBATCH --reservation=big"]')
    assert config.slurm.extra_sbatch == ["#SBATCH --mail-type=END", "#SBATCH --reservation=big"]


def test_custom_template(tmp_path: Path) -> None:
    template = tmp_path / "my.sbatch.j2"
    template.write_text(
        "#!/bin/bash\n#SBATCH --nodes={{ num_nodes }}\necho {{ run_dir | quote }} {{ env.PYTHONUNBUFFERED }}\n"
    )
    script = _render(tmp_path, "--slurm.template-path", str(template))
    assert script == f"#!/bin/bash\n#SBATCH --nodes=1\necho {tmp_path / 'run'} 1\n"


def test_template_errors_name_the_variable_or_line(tmp_path: Path) -> None:
    template = tmp_path / "bad.j2"
    template.write_text("#!/bin/bash\necho {{ nodes }}\n")
    with pytest.raises(LaunchError, match=r"slurm.template_path .*bad.j2: 'nodes' is undefined \(the variables are: "):
        _render(tmp_path, "--slurm.template-path", str(template))
    template.write_text("#!/bin/bash\n\necho {% if %}\n")
    with pytest.raises(LaunchError, match=r"bad.j2, line 3: "):
        _render(tmp_path, "--slurm.template-path", str(template))
    with pytest.raises(LaunchError, match=r"slurm.template_path .*missing.j2: cannot be read: No such file"):
        _render(tmp_path, "--slurm.template-path", str(tmp_path / "missing.j2"))


def test_dry_run_prints_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "run")
    assert cli_main(["slurm", "@", str(config), "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")
    assert not (tmp_path / "run").exists()
    # `sft --slurm` is the same command
    assert cli_main(["train", "--slurm", "@", str(config), "--dry-run"]) == 0
    assert "-m lmforge train @ " in capsys.readouterr().out


def test_no_submit_writes_the_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "run")
    assert cli_main(["slurm", "@", str(config), "--no-submit"]) == 0
    run = tmp_path / "run"
    script = run / "slurm" / "job.sbatch"
    assert script.read_text().startswith("#!/bin/bash\n")
    assert script.stat().st_mode & stat.S_IXUSR
    assert (run / "config.toml").exists() and (run / "logs").is_dir()
    assert f"sbatch {script}" in capsys.readouterr().out


def test_config_errors_read_as_train_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "run")
    assert cli_main(["train", "@", str(config), "--optim.lr", "-1"]) == 2
    from_train = capsys.readouterr().err.replace("lmforge train:", "")
    assert cli_main(["slurm", "@", str(config), "--optim.lr", "-1"]) == 2
    from_slurm = capsys.readouterr().err.replace("lmforge slurm:", "")
    assert "optim.lr (from the command line)" in from_slurm
    assert from_slurm == from_train
    assert not (tmp_path / "run").exists()


def test_missing_sbatch_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cli_main(["slurm", "@", str(write_config(tmp_path, "run"))]) == 2
    err = capsys.readouterr().err
    assert "lmforge slurm: error: sbatch not found on PATH" in " ".join(err.split())


def test_sbatch_refusal_shows_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in sbatch that refuses like Slurm does; tests/integration/test_multinode.py submits to a real Slurm.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert cli_main(["slurm", "@", str(write_config(tmp_path, "run"))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "sbatch refused the job" in err and "Batch job submission failed: Invalid account" in err
