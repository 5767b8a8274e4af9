"""The light commands start without importing torch: `lmforge --help`, the `--help` of train, mix and tokenize,
`lmforge train --dry-run`, `lmforge slurm --dry-run`, and every config error (a bad field, a missing file, a bad
pretrained folder). Each runs in a fresh interpreter that reports, after the command, whether torch was imported;
the command's own output is checked too, so a command that failed early cannot pass for a light one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.runner import write_config

PROBE = """
import io, json, sys, contextlib
from lmforge.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy}))
"""
"""Runs `lmforge ARGS` in-process and prints its exit code, its output and whether it imported torch."""


def probe(args: list[str], cwd: Path) -> dict[str, object]:
    """What `lmforge <args>` did in a fresh interpreter (see `PROBE`)."""
    result = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                            cwd=cwd, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def configs(tmp_path: Path) -> dict[str, Path]:
    good = write_config(tmp_path, "run")
    bad_field = tmp_path / "bad_field.toml"
    bad_field.write_text(good.read_text().replace("lr = 3e-3", "lr = 3e-3\nbogus = 1"))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {"good": good, "bad_field": bad_field, "folder": folder}


CASES = {
    "usage": (["--help"], 0, "commands:"),
    "train help": (["train", "--help"], 0, "[data]"),
    "train help of a section": (["train", "--help", "optim"], 0, "lr"),
    "mix help": (["mix", "--help"], 0, "usage: lmforge mix"),
    "tokenize help": (["tokenize", "--help"], 0, "usage: lmforge tokenize"),
    "train dry run": (["train", "@", "{good}", "--dry-run"], 0, "max_steps = 6"),
    "slurm dry run": (["slurm", "@", "{good}", "--dry-run"], 0, "#SBATCH"),
    "a bad field": (["train", "@", "{bad_field}"], 2, "optim.bogus"),
    "a missing file": (["train", "@", "{good}.missing"], 2, "missing"),
    "a bad value for slurm": (["slurm", "@", "{good}", "--optim.lr", "fast"], 2, "optim.lr"),
    "a bad pretrained folder": (["train", "@", "{good}", "--model.name", "{folder}"], 2, "config.json: required field"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_light_command_imports_no_torch(case: str, configs: dict[str, Path], tmp_path: Path) -> None:
    template, code, expected = CASES[case]
    args = [a.format(**{k: str(v) for k, v in configs.items()}) for a in template]
    seen = probe(args, tmp_path)
    assert seen["code"] == code, seen
    assert expected in str(seen["out"]) + str(seen["err"]), seen
    assert seen["heavy"] == [], f"lmforge {' '.join(args)} imported {seen['heavy']}"


def test_the_probe_sees_torch_when_a_command_loads_it(tmp_path: Path) -> None:
    # A command that needs the model (sample) imports torch before it reads its arguments' files.
    seen = probe(["sample", str(tmp_path / "nothing"), "--prompt", "x"], tmp_path)
    assert seen["code"] == 2 and "torch" in seen["heavy"], seen
