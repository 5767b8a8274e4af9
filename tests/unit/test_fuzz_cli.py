"""Fuzzing of the command line: whatever the arguments and config files, `lmforge.cli.main` returns 0 or 2, and bad
input is reported as one `lmforge COMMAND: error: ...` message on stderr, never as a traceback.

Hypothesis draws TOML files and flag lists for `lmforge train --dry-run`, and argument lists made of the real flags
of the other commands. Every path it draws lies in a fresh folder per example, which is also the working directory,
so a command never reads real data or writes outside the test's tmp dir.

The "ci" profile runs `CI_EXAMPLES` examples per test; with LMFORGE_FUZZ_EXAMPLES set, the "long" profile runs that
many (2000 if it is not a number). Either way hypothesis prints a failing example's draws and a replay blob:

    LMFORGE_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/unit/test_fuzz_cli.py --hypothesis-show-statistics

The profile is applied to each test by decorator rather than loaded globally, so importing this file does not change
the settings of other hypothesis tests.

Below the fuzz tests, plain regression tests pin each bug the fuzzing found.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import yaml
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from lmforge.cli import COMMANDS, main
from lmforge.config.fields import ROOT, field_rows, section_names

# ---------------------------------------------------------------------------------------------------------------
# Profiles

CI_EXAMPLES = 200
"""Examples per fuzz test in the CI profile."""

_LONG = os.environ.get("LMFORGE_FUZZ_EXAMPLES", "").strip()
_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    # Nothing is stored under .hypothesis/ in the checkout; a failure prints its example and a replay blob instead.
    "database": None,
    "print_blob": True,
}
settings.register_profile("ci", max_examples=CI_EXAMPLES, **_COMMON)
settings.register_profile("long", max_examples=int(_LONG) if _LONG.isdigit() and int(_LONG) > 0 else 2000, **_COMMON)
PROFILE = settings.get_profile("long" if _LONG else "ci")
"""The settings of every fuzz test: the long profile when LMFORGE_FUZZ_EXAMPLES is set, else the CI one."""


# ---------------------------------------------------------------------------------------------------------------
# Values

ODD_TEXTS = [
    "",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\\",
    '"',
    "'",
    "\u202eevil.toml",  # right-to-left override
    "שלום עולם",
    "مرحبا",
    "🔥🤖👩‍👩‍👧",
    "e\u0301",
    "\ufeffbom",
    "\u200b",
    "[bold]markup[/]",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e999",
    "-1",
    "0",
    "0x10",
    "1_000",
    "9" * 5000,
    "-" + "9" * 5000,
    "[]",
    "{}",
    "[1, 2]",
    '["a", 1, [true]]',
    "{a = 1}",
    '{ name = "x", path = "y" }',
    "true",
    "false",
    "1979-05-27",
    "1979-05-27T07:32:00Z",
    "07:32:00",
    "@",
    "@@",
    "--",
    "-",
    "--dry-run",
    "=",
    "x = 1\ny = 2",
    "a\x00b",
    "auto",
    "latest",
    "llama",
    "fake",
    "muon",
]
"""Strings that trip parsers: empty, whitespace, right-to-left, emoji, NUL, number and TOML look-alikes."""

TEXT = st.one_of(st.sampled_from(ODD_TEXTS), st.text(st.characters(exclude_categories=("Cs",)), max_size=24))
"""Any text TOML can hold (no surrogates), odd strings favored."""

ARG_TEXT = TEXT.map(lambda s: s.replace("\x00", ""))
"""Text that can be a command-line argument: a process's argv cannot hold NUL."""

INTS = st.one_of(
    st.sampled_from([0, 1, -1, 2, 7, 64, 128, 1024, 2**31, 2**63 - 1, -(2**63), 2**64, 10**30, -(10**30)]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-300, 5e-324, 1e300]), st.floats())
NUMBER_TEXT = st.one_of(INTS.map(str), FLOATS.map(repr), st.sampled_from(["9" * 5000, "1e999", "-1e999", "NaN"]))
"""Numbers as a flag would carry them, NaN and infinities included."""

ARG_VALUE = st.one_of(ARG_TEXT, NUMBER_TEXT)
"""A value for any flag: text or a number."""

PLAUSIBLE = st.sampled_from(
    [
        *["1", "2", "4", "64", "128", "256", "512", "1024", "0", "0.5", "1e-3", "0.02", "true", "false", "auto"],
        *["llama", "qwen3", "glm4_moe", "qwen3_moe", "fake", "tokens", "sft", "muon", "adamw", "completep", "full"],
        *["selective", "[]", '["a"]', '["assistant"]', "latest", "offline", "cosine", "[1, 2, 3]", '"runs/y"'],
    ]
)
"""Values a real field may well take, so that a flag often changes a config that is otherwise valid."""

TOML_SCALARS = st.one_of(
    st.booleans(), INTS, FLOATS, TEXT, st.datetimes(), st.dates(), st.times(), st.sampled_from(["llama", "fake"])
)
TOML_VALUES = st.recursive(
    TOML_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=8,
)
"""Any value TOML can hold: scalars, dates and times, lists and tables."""

FIELDS = sorted({row.path for row in field_rows() if "[]" not in row.path})
SECTIONS = [name for name in section_names() if name != ROOT]
UNKNOWN = ["data.seq_lenn", "model.arch.hiddensize", "parallel.cp", "optim.lr.value", "a..b", "", ".", "🔥.x", "x"]
DOTTED = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(SECTIONS),
    st.sampled_from(UNKNOWN),
    st.lists(TEXT, min_size=1, max_size=3).map(".".join),
)
"""A dotted config name: a real field or section of `TrainConfig`, a near miss, or any text."""

SAFE_NAME = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="/\x00"), min_size=1, max_size=16
).filter(lambda s: s not in (".", "..") and len(s.encode()) < 120)
"""A file name that stays inside its folder: no `/`, NUL, `.` or `..`."""

BASE = {
    "max_steps": 10,
    "output_dir": "runs/fuzz",
    "model": {
        "arch": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 1024,
        }
    },
    "data": {"type": "fake", "seq_len": 128, "batch_tokens": 1024, "micro_batch_tokens": 256},
    "optim": {"lr": 1e-3},
}
"""A valid train config, so that mutations of single fields get past the missing required fields."""

MALFORMED_TOML = [
    b"[data\nseq_len = 1\n",
    b"a = \n",
    b"= 1\n",
    b"a = 1\na = 2\n",
    b"[data]\n[data]\n",
    b"[[data]]\nseq_len = 1\n",
    b'a = "\\uD800"\n',
    b"a = 1979-13-45\n",
    b"a = " + b"9" * 5000 + b"\n",
    b"max_steps = " + b"1" * 4301 + b"\n",
    b"\xff\xfe\x00a = 1\n",
    b"a = '\xc3\x28'\n",
    b"\xef\xbb\xbfmax_steps = 1\n",
    b"a = 1\x00\n",
    b"a = [1, 2\n",
    b'a = """\n',
    b"[a.b]\nc = 1\n[a]\nb = 2\n",
    b"",
]
"""TOML files that do not parse: syntax errors, bad escapes and dates, huge integers, bad UTF-8, NUL, a BOM."""


def nest(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A TOML tree from (dotted name, value) pairs, later pairs winning as the loader's flags do."""
    tree: dict[str, Any] = {}
    for dotted, value in pairs:
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return tree


def toml_bytes(data: st.DataObject, base: dict[str, Any] | None = None) -> bytes:
    """Draw the bytes of a TOML file: random fields on top of `base`, a mangled valid file, or a malformed one."""
    choice = data.draw(st.sampled_from(["tree", "tree", "tree", "mangled", "malformed", "binary"]), label="toml kind")
    if choice == "malformed":
        return data.draw(st.sampled_from(MALFORMED_TOML), label="malformed toml")
    if choice == "binary":
        return data.draw(st.binary(max_size=64), label="toml bytes")
    pairs = data.draw(st.lists(st.tuples(DOTTED, TOML_VALUES), max_size=6), label="fields")
    tree = nest(pairs)
    if base is not None and data.draw(st.booleans(), label="on base"):
        tree = _merge(json.loads(json.dumps(base)), tree)
    text = tomli_w.dumps(tree).encode()
    if choice == "mangled" and text:
        at = data.draw(st.integers(0, len(text)), label="cut at")
        junk = data.draw(st.sampled_from([b"", b"[", b"=", b'"', b"\n[x", b"\xff", b"]]", b"\x00"]), label="junk")
        text = text[:at] + junk + text[at + data.draw(st.integers(0, 3), label="cut") :]
    return text


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


# ---------------------------------------------------------------------------------------------------------------
# Running a command


@contextlib.contextmanager
def sandbox(root: Path) -> Iterator[Path]:
    """A fresh empty folder under `root`, the working directory while the block runs, removed after it."""
    folder = Path(tempfile.mkdtemp(dir=root))
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(before)
        shutil.rmtree(folder, ignore_errors=True)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `main(argv)`; (exit code, stdout, stderr). `SystemExit` counts as an exit code, as argparse raises it
    for usage errors; any other exception fails the test with the arguments that raised it."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `main(argv)` and assert the contract: exit 0 or 2, no traceback, and for 2 one error message."""
    code, out, err = run_cli(argv, capsys)
    if currently_in_test_context():  # `pytest --hypothesis-show-statistics` tallies the outcomes
        event(f"exit {code}")
    assert code in (0, 2), f"exit code {code} for {argv!r}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in out + err, f"a traceback for {argv!r}:\n{err}"
    if code == 2:
        name = "tokenizer train" if argv[:2] == ["tokenizer", "train"] else argv[0]
        # An unknown command is echoed as rich prints it: tabs expanded, some control characters dropped.
        head = f"lmforge {name}: error:" if argv[0] in COMMANDS else ": error: unknown command"
        # Counted in the whole text, not per line: a value may hold line breaks (even \x85 or \u2028).
        assert err.count(head) == 1, f"expected one error message for {argv!r}, got:\n{err}"
    return code, out, err


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-process environment (only rank 0 prints errors), a tripwire on training, which a dry run must never
    reach, and an eval worker that returns at once instead of polling for snapshots (a fuzzed run directory may well
    hold a valid config with [val] sets)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("a fuzzed `lmforge train ... --dry-run` went on to prepare a run")

    import lmforge.checkpoint.run_dir
    import lmforge.eval.worker

    monkeypatch.setattr(lmforge.checkpoint.run_dir, "prepare_run", tripwire)
    monkeypatch.setattr(lmforge.eval.worker, "run_worker", lambda *args, **kwargs: None)


# ---------------------------------------------------------------------------------------------------------------
# `lmforge train`


def write_base(folder: Path) -> str:
    """Write the valid base config into `folder`; returns its path."""
    path = folder / "base.toml"
    path.write_text(tomli_w.dumps(BASE), encoding="utf-8")
    return str(path)


def draw_config_path(data: st.DataObject, folder: Path, content: bytes) -> str:
    """Draw where a config file is: `content` written under a random name, or a path that is no TOML file."""
    kind = data.draw(st.sampled_from(["file", "file", "file", "missing", "folder", "empty name", "dot"]), label="at")
    if kind == "missing":
        return str(folder / data.draw(SAFE_NAME, label="missing name"))
    if kind == "folder":
        return str(folder)
    if kind == "empty name":
        return ""
    if kind == "dot":
        return "."
    name = data.draw(st.one_of(st.just("fuzz.toml"), SAFE_NAME), label="file name")
    path = folder / name
    path.write_bytes(content)
    return str(path)


def check_round_trip(out: str, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dry run's printout is TOML that loads back to the same config."""
    dumped = folder / "dumped.toml"
    dumped.write_text(out, encoding="utf-8")
    code, again, err = check(["train", "@", str(dumped), "--dry-run"], capsys)
    assert (code, again) == (0, out), f"the dry run's config does not load back:\n{out}\n{err}"


@PROFILE
@given(data=st.data())
def test_train_config_files(
    data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None
) -> None:
    """`lmforge train @ [base] @ FILE ... --dry-run` with random, malformed and missing config files."""
    with sandbox(tmp_path) as folder:
        argv = ["train"]
        if data.draw(st.booleans(), label="base first"):
            argv += ["@", write_base(folder)]
        for _ in range(data.draw(st.integers(1, 2), label="files")):
            path = draw_config_path(data, folder, toml_bytes(data, BASE))
            argv += [f"@{path}"] if data.draw(st.booleans(), label="attached @") and path else ["@", path]
        code, out, _ = check([*argv, "--dry-run"], capsys)
        if code == 0:
            check_round_trip(out, folder, capsys)


def flag_name(data: st.DataObject) -> str:
    """Draw a flag for a dotted name, written with dashes, underscores or both."""
    dotted = data.draw(DOTTED, label="flag field")
    style = data.draw(st.sampled_from(["dash", "underscore", "as is"]), label="style")
    if style == "dash":
        return dotted.replace("_", "-")
    if style == "underscore":
        return dotted.replace("-", "_")
    return dotted


def draw_flags(data: st.DataObject) -> list[str]:
    """Draw `--name VALUE`, `--name=VALUE`, `--name` and `--no-name` flags."""
    flags: list[str] = []
    for _ in range(data.draw(st.integers(0, 5), label="flags")):
        name = flag_name(data).replace("\x00", "")
        form = data.draw(st.sampled_from(["pair", "pair", "equals", "bare", "no"]), label="form")
        if form == "bare":
            flags.append(f"--{name}")
        elif form == "no":
            flags.append(f"--no-{name}")
        else:
            value = data.draw(mostly(PLAUSIBLE, ARG_VALUE, 5), label="value")
            flags += [f"--{name}={value}"] if form == "equals" else [f"--{name}", value]
    return flags


@PROFILE
@given(data=st.data())
def test_train_flags(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge train @ base.toml FLAGS --dry-run` with random flags over real, near-miss and unknown names."""
    with sandbox(tmp_path) as folder:
        argv = ["train", "@", write_base(folder), *draw_flags(data), "--dry-run"]
        code, out, _ = check(argv, capsys)
        # a bare --slurm submits the run as a Slurm job instead, and its dry run prints the job script
        submits = any(a == "--slurm" and b.startswith(("--", "@")) for a, b in itertools.pairwise(argv))
        if code == 0 and "--help" not in argv and "-h" not in argv and not submits:
            check_round_trip(out, folder, capsys)
        if code == 0 and submits:
            assert out.startswith("#!/bin/bash\n")


# ---------------------------------------------------------------------------------------------------------------
# The other commands


def jsonish() -> st.SearchStrategy[Any]:
    """JSON values, NaN and infinities included (Python's json writes and reads them)."""
    scalars = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
        max_leaves=6,
    )


def jsonl_bytes(data: st.DataObject, keys: list[str], values: st.SearchStrategy[Any]) -> bytes:
    """Draw JSON lines: objects over `keys` (plus odd keys), other JSON values, broken lines, bad UTF-8."""
    record = st.dictionaries(st.one_of(st.sampled_from(keys), TEXT), values, max_size=len(keys) + 1)
    line = st.one_of(
        record.map(lambda r: json.dumps(r, ensure_ascii=False)),
        record.map(json.dumps),
        jsonish().map(json.dumps),
        st.sampled_from(["", "{", "not json", '{"a": 1}}', "\xff", "[1, 2]", "null", '"text"']),
    )
    lines = data.draw(st.lists(line, max_size=5), label="lines")
    text = "\n".join(lines).encode()
    if data.draw(st.integers(0, 9), label="bad bytes") == 0:
        text += b"\n\xff\xfe"
    return text


def draw_path(data: st.DataObject, folder: Path, label: str, contents: Callable[[], bytes] | None = None) -> str:
    """Draw a path inside `folder`: a missing one, an empty folder, a file of random bytes, a file of `contents`,
    or the folder itself; relative (to the working directory, `folder`) or absolute."""
    kinds = ["missing", "missing", "empty dir", "junk file", "dot", "nested missing"]
    if contents is not None:
        kinds += ["contents", "contents", "contents"]
    kind = data.draw(st.sampled_from(kinds), label=f"{label} kind")
    if kind == "dot":
        return data.draw(st.sampled_from([".", str(folder), "./"]), label=label)
    name = data.draw(SAFE_NAME, label=f"{label} name")
    suffix = data.draw(st.sampled_from(["", "", ".txt", ".jsonl", ".parquet", ".toml", ".png", ".json"]), label="ext")
    path = folder / (name + suffix)
    if kind == "nested missing":
        path = folder / name / "deeper" / (name + suffix)
    elif kind == "empty dir" and not path.exists():
        path.mkdir()
    elif kind == "junk file" and not path.exists():
        path.write_bytes(data.draw(st.binary(max_size=48), label=f"{label} bytes"))
    elif kind == "contents" and not path.exists():
        assert contents is not None
        path.write_bytes(contents())
    relative = data.draw(st.booleans(), label=f"{label} relative")
    return str(path.relative_to(folder)) if relative else str(path)


def draw_run_dir(data: st.DataObject, folder: Path, label: str = "run") -> str:
    """Draw a run directory: missing, or a folder with random metrics.jsonl, config.toml and checkpoints/."""
    if data.draw(st.integers(0, 3), label=f"{label} missing") == 0:
        return draw_path(data, folder, label)
    run = folder / data.draw(SAFE_NAME, label=f"{label} name")
    if run.exists():
        return str(run)
    run.mkdir()
    if data.draw(st.booleans(), label="metrics"):
        step = st.one_of(INTS, st.just(None), TEXT, FLOATS, st.booleans())
        value = st.one_of(FLOATS, INTS, st.none(), st.booleans(), TEXT)
        keys = ["step", "loss/mean", "optim/lr", "val/x/bpb@128", "tokens"]
        records = st.fixed_dictionaries({"step": step}, optional={k: value for k in keys[1:]})
        lines = data.draw(st.lists(st.one_of(records.map(json.dumps), st.just("{")), max_size=4), label="metrics")
        tail = data.draw(st.sampled_from([b"", b"\n", b"\xff"]), label="tail")
        (run / "metrics.jsonl").write_bytes("\n".join(lines).encode() + tail)
    if data.draw(st.booleans(), label="config"):
        (run / "config.toml").write_bytes(toml_bytes(data, BASE))
    if data.draw(st.integers(0, 3), label="checkpoints") == 0:
        root = run / "checkpoints"
        steps = ["step_1", "step_x", ".tmp_step_1", "step_²"]
        step = data.draw(st.sampled_from(steps), label="step dir")
        (root / step / "model").mkdir(parents=True)
        for name in data.draw(st.sets(st.sampled_from([".metadata", "trainer.json", "model/config.json"])), label="f"):
            (root / step / name).write_bytes(data.draw(st.sampled_from([b"", b"{}", b"[", b'{"model_type": 1}'])))
        if data.draw(st.booleans(), label="latest"):
            latest = [b"1", b"x", b"", b"-1", b"\xb2", "²".encode()]
            (root / "latest").write_bytes(data.draw(st.sampled_from(latest), label="latest step"))
    return str(run)


def mostly(likely: st.SearchStrategy[Any], rest: st.SearchStrategy[Any], tenths: int = 8) -> st.SearchStrategy[Any]:
    """`likely` in about `tenths` of ten draws, else `rest`: well-typed values go deeper into a command than junk
    does, which argparse turns away at once."""
    return st.integers(0, 9).flatmap(lambda n: likely if n < tenths else rest)


def options(
    data: st.DataObject, spec: dict[str, Callable[[], str | None]], required: tuple[str, ...] = ()
) -> list[str]:
    """Draw a command's options in any order: each `required` one nearly always, each other one about half the
    time, now and then one twice. A builder returning None is a switch that takes no value."""
    chosen = [flag for flag in spec if data.draw(st.integers(0, 9), label=f"{flag}?") < (9 if flag in required else 5)]
    chosen += data.draw(st.lists(st.sampled_from(sorted(spec)), max_size=1), label="repeated")
    argv: list[str] = []
    for flag in data.draw(st.permutations(chosen), label="order"):
        value = spec[flag]()
        argv += [flag] if value is None else [flag, value]
    return argv


JUNK_ARGS = st.sampled_from(["--bogus", "-x", "--", "-", "--output", "extra", "-o", "--overwrite", "🔥", "-h"])


def with_junk(data: st.DataObject, argv: list[str]) -> list[str]:
    """`argv` with a stray argument or two inserted somewhere, in about one example of five."""
    argv = list(argv)
    junk = data.draw(mostly(st.just([]), st.lists(JUNK_ARGS, min_size=1, max_size=2)), label="junk")
    for arg in junk:
        argv.insert(data.draw(st.integers(0, len(argv)), label="junk at"), arg)
    return argv


def value(data: st.DataObject, strategy: st.SearchStrategy[str], label: str) -> Callable[[], str]:
    """A builder drawing one value from `strategy`."""
    return lambda: data.draw(strategy, label=label)


def switch() -> None:
    """The builder of a flag that takes no value."""
    return None


SMALL_INTS = st.integers(-2, 300)


def int_arg(data: st.DataObject, label: str) -> Callable[[], str]:
    """A builder drawing an integer flag value: mostly a small one, else any integer, number or text."""
    return value(data, mostly(SMALL_INTS.map(str), st.one_of(INTS.map(str), NUMBER_TEXT, ARG_TEXT)), label)


def float_arg(data: st.DataObject, label: str) -> Callable[[], str]:
    """A builder drawing a float flag value: mostly a float, NaN and infinities included, else a number or text."""
    return value(data, mostly(FLOATS.map(repr), st.one_of(NUMBER_TEXT, ARG_TEXT)), label)


def path_arg(data: st.DataObject, folder: Path, label: str, contents: Callable[[], bytes] | None = None) -> Callable:
    """A builder drawing a path inside `folder`."""
    return lambda: draw_path(data, folder, label, contents)


def positionals(data: st.DataObject, build: Callable[[], str], most: int = 1) -> list[str]:
    """Draw 0 to `most` positional arguments (usually at least one)."""
    least = 0 if data.draw(st.integers(0, 9), label="no positional") == 0 else 1
    return [build() for _ in range(data.draw(st.integers(least, max(least, most)), label="positionals"))]


def fuzz_command(data: st.DataObject, capsys: pytest.CaptureFixture[str], command: list[str], argv: list[str]) -> None:
    """Run `command + argv`, with stray arguments drawn in, under the contract of `check`."""
    check([*command, *with_junk(data, argv)], capsys)


def text_file(data: st.DataObject) -> Callable[[], bytes]:
    """Builder of a small input text: plain text, JSON lines with a text field, or junk bytes."""

    def build() -> bytes:
        kind = data.draw(st.sampled_from(["text", "jsonl", "bytes"]), label="text kind")
        if kind == "jsonl":
            return jsonl_bytes(data, ["text", "content"], jsonish())
        if kind == "bytes":
            return data.draw(st.binary(max_size=40), label="text bytes")
        return data.draw(st.text(max_size=80), label="text").encode()

    return build


@PROFILE
@given(data=st.data())
def test_tokenize(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge tokenize INPUT ... --tokenizer DIR --output DIR [...]`: never a real tokenizer, so nothing runs."""
    with sandbox(tmp_path) as folder:
        spec = {
            "--tokenizer": path_arg(data, folder, "tokenizer"),
            "--output": path_arg(data, folder, "output"),
            "--text-key": value(data, ARG_TEXT, "text key"),
            "--tasks": int_arg(data, "tasks"),
            "--workers": int_arg(data, "workers"),
            "--max-tokens-per-file": int_arg(data, "max tokens"),
            "--seed": int_arg(data, "seed"),
            "--holdout": float_arg(data, "holdout"),
            "--holdout-output": path_arg(data, folder, "holdout output"),
            "--overwrite": switch,
        }
        inputs = positionals(data, path_arg(data, folder, "input", text_file(data)), 3)
        fuzz_command(data, capsys, ["tokenize"], [*inputs, *options(data, spec, ("--tokenizer", "--output"))])


@PROFILE
@given(data=st.data())
def test_tokenizer_train(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge tokenizer train INPUT ... --output DIR [...]` on inputs of a few bytes at most."""
    with sandbox(tmp_path) as folder:
        spec = {
            "--output": path_arg(data, folder, "output"),
            "--vocab-size": int_arg(data, "vocab size"),
            "--min-frequency": int_arg(data, "min frequency"),
            "--text-key": value(data, ARG_TEXT, "text key"),
            "--model-max-length": int_arg(data, "model max length"),
            "--overwrite": switch,
        }
        inputs = positionals(data, path_arg(data, folder, "input", text_file(data)), 2)
        sub = data.draw(mostly(st.just(["train"]), st.sampled_from([[], ["bogus"], ["-h"]]), 9), label="subcommand")
        fuzz_command(data, capsys, ["tokenizer", *sub], [*inputs, *options(data, spec, ("--output",))])


@PROFILE
@given(data=st.data())
def test_export(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge export SOURCE --output DIR [--dtype D] [--max-shard-size GB]` on run directories without weights."""
    with sandbox(tmp_path) as folder:
        spec = {
            data.draw(st.sampled_from(["--output", "-o"]), label="output flag"): path_arg(data, folder, "output"),
            "--dtype": value(
                data, mostly(st.sampled_from(["bfloat16", "float32"]), st.one_of(st.just("float16"), ARG_TEXT)), "dtype"
            ),
            "--max-shard-size": float_arg(data, "shard size"),
        }
        source = positionals(data, lambda: draw_run_dir(data, folder))
        fuzz_command(data, capsys, ["export"], [*source, *options(data, spec, ("--output", "-o"))])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF model folder with a tokenizer: a one-layer Llama of width 16 and a context of 16 tokens, so that
    `lmforge sample` gets as far as generating, and a long prompt overflows the context."""
    import torch

    from lmforge.config.arch import LlamaArch
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.hf.folder import write_model_files
    from lmforge.hf.names import export_tensors
    from lmforge.hf.weights import write_safetensors
    from lmforge.model import build_model
    from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

    folder = tmp_path_factory.mktemp("tiny_model")
    save_tokenizer_folder(train_bpe(["to be or not to be", "that is the question"], 300, 1), folder)
    tokenizer = load_tokenizer(folder)
    arch = LlamaArch(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16
    )
    model = build_model(arch, tokenizer.size, "sdpa", torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # built uninitialized; NaN weights would make every sample fail
            param.normal_(0.0, 0.05, generator=generator)
    write_model_files(folder, arch, tokenizer.size, tokenizer)
    write_safetensors(export_tensors(model, torch.float32), folder)
    return folder


@PROFILE
@given(data=st.data())
def test_sample(
    data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None, tiny_model: Path
) -> None:
    """`lmforge sample MODEL --prompt TEXT [...]` on a tiny real model and on folders that hold no model."""
    with sandbox(tmp_path) as folder:
        spec = {
            "--prompt": value(data, st.one_of(ARG_TEXT, st.just("to be or not " * 8)), "prompt"),
            "--chat": switch,
            "--max-new-tokens": int_arg(data, "max new tokens"),
            "--temperature": float_arg(data, "temperature"),
            "--top-p": float_arg(data, "top p"),
            "--seed": int_arg(data, "seed"),
            "--device": value(
                data,
                mostly(st.sampled_from(["auto", "cpu"]), st.sampled_from(["cuda:99", "meta", "tpu", "cpu:1", ""])),
                "d",
            ),
        }

        def model() -> str:
            if data.draw(st.booleans(), label="tiny model"):
                return str(tiny_model)
            return draw_run_dir(data, folder, "model")

        fuzz_command(data, capsys, ["sample"], [*positionals(data, model), *options(data, spec, ("--prompt",))])


@PROFILE
@given(data=st.data())
def test_eval(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge eval RUN_DIR [...]` on run directories with random config.toml files."""
    with sandbox(tmp_path) as folder:
        spec = {
            "--poll-seconds": float_arg(data, "poll seconds"),
            "--latest-only": switch,
            "--limit": int_arg(data, "limit"),
        }
        run = positionals(data, lambda: draw_run_dir(data, folder))
        fuzz_command(data, capsys, ["eval"], [*run, *options(data, spec)])


VAL_SET_KEYS = ["context", "query", "ctx", "choices", "gold", "sentence_good", "sentence_bad"]


@PROFILE
@given(data=st.data())
def test_val_sets(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge val-sets INPUT --kind K --output DIR [...]` on random JSON lines."""
    with sandbox(tmp_path) as folder:
        row_values = st.one_of(jsonish(), st.lists(TEXT, max_size=4), INTS)
        spec = {
            "--kind": value(data, mostly(st.sampled_from(["ctxcont", "pairs"]), ARG_TEXT), "kind"),
            "--output": path_arg(data, folder, "output"),
            "--name": value(data, mostly(st.from_regex(r"[A-Za-z0-9][\w.-]{0,8}", fullmatch=True), ARG_TEXT), "name"),
            "--delimiter": value(data, ARG_TEXT, "delimiter"),
        }
        rows = path_arg(data, folder, "input", lambda: jsonl_bytes(data, VAL_SET_KEYS, row_values))
        fuzz_command(
            data, capsys, ["val-sets"], [*positionals(data, rows), *options(data, spec, ("--kind", "--output"))]
        )


TASK_FIELDS = ["q", "opts", "gold", "text", "choices"]
TEMPLATES = st.one_of(
    st.sampled_from(TASK_FIELDS),
    st.sampled_from(["{{q}}", "{{q}} {{text}}:", "{{[q, text]}}", "{{gold}}", "{{opts[gold]}}", "{{opts}}", "{{", "{%",
                     "{{q.__class__.__mro__}}", "{{range(10**9)|list}}", "{{ q | regex_replace('a', 'b') }}", "[1, 2]",
                     "{{missing}}", "0", "12", ""]),
    TEXT,
)  # fmt: skip
TASK_VALUES = st.one_of(TEMPLATES, INTS, st.lists(TEMPLATES, max_size=3), st.dictionaries(TEXT, TEXT, max_size=2))


def task_yaml(data: st.DataObject) -> bytes:
    """A harness task file: task fields with field names, templates or junk as values, a `!function`, or junk."""
    kind = data.draw(st.sampled_from(["task", "task", "task", "function", "bytes"]), label="task kind")
    if kind == "bytes":
        return data.draw(st.binary(max_size=60), label="task bytes")
    keys = ["output_type", "doc_to_text", "doc_to_choice", "doc_to_target", "target_delimiter", "description",
            "num_fewshot", "include", "task", "test_split", "dataset_kwargs", "process_docs"]  # fmt: skip
    task: dict[str, Any] = {
        "output_type": data.draw(mostly(st.sampled_from(["multiple_choice", "loglikelihood_rolling"]), TEXT), "type")
    }
    task.update(data.draw(st.dictionaries(st.sampled_from(keys), TASK_VALUES, max_size=5), label="task fields"))
    text = yaml.safe_dump(task, allow_unicode=True)
    if kind == "function":
        text += f"doc_to_text: !function {data.draw(TEXT, label='function')!r}\n"
    return text.encode()


@PROFILE
@given(data=st.data())
def test_val_sets_task(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge val-sets TASK.yaml --output DIR [--data FILE] [--name NAME]` on random task files and rows."""
    with sandbox(tmp_path) as folder:
        row_values = st.one_of(jsonish(), st.lists(TEXT, max_size=4), INTS)
        spec = {
            "--output": path_arg(data, folder, "output"),
            "--name": value(data, mostly(st.from_regex(r"[A-Za-z0-9][\w.-]{0,8}", fullmatch=True), ARG_TEXT), "name"),
            "--data": path_arg(data, folder, "data", lambda: jsonl_bytes(data, TASK_FIELDS, row_values)),
        }
        task = folder / data.draw(st.sampled_from(["task.yaml", "t.yml"]), label="task name")
        task.write_bytes(task_yaml(data))
        fuzz_command(data, capsys, ["val-sets"], [str(task), *options(data, spec, ("--output",))])


def output_image(data: st.DataObject, folder: Path, suffixes: list[str]) -> Callable[[], str]:
    """A builder of an output path with one of `suffixes` (or none), possibly in a missing folder."""

    def build() -> str:
        path = Path(draw_path(data, folder, "output"))
        if not path.name:  # "." names the folder itself
            path = path / "out"
        return str(path.with_name(path.name + data.draw(st.sampled_from(suffixes), label="suffix")))

    return build


@pytest.mark.filterwarnings("ignore:Glyph .* missing from font:UserWarning")  # metric names in odd scripts
@PROFILE
@given(data=st.data())
def test_plot(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge plot RUN_DIR ... -o IMAGE [--metric P ...] [--smoothing W]` on random metrics."""
    with sandbox(tmp_path) as folder:
        patterns = st.one_of(st.sampled_from(["loss/mean", "*", "val/*/bpb@*", "[", "optim/*"]), ARG_TEXT)
        spec = {
            data.draw(st.sampled_from(["-o", "--output"]), label="o"): output_image(data, folder, [".png", ".svg", ""]),
            data.draw(st.sampled_from(["-m", "--metric"]), label="m"): value(data, patterns, "pattern"),
            "--smoothing": float_arg(data, "smoothing"),
        }
        runs = positionals(data, lambda: draw_run_dir(data, folder), 2)
        fuzz_command(data, capsys, ["plot"], [*runs, *options(data, spec, ("-o", "--output"))])


@PROFILE
@given(data=st.data())
def test_report(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge report RUN_DIR -o report.html [--smoothing W]` on random metrics and configs."""
    with sandbox(tmp_path) as folder:
        spec = {
            data.draw(st.sampled_from(["-o", "--output"]), label="o"): output_image(data, folder, [".html", ""]),
            "--smoothing": float_arg(data, "smoothing"),
        }
        run = positionals(data, lambda: draw_run_dir(data, folder))
        fuzz_command(data, capsys, ["report"], [*run, *options(data, spec, ("-o", "--output"))])


def mix_toml(data: st.DataObject) -> Callable[[], bytes]:
    """Builder of a mix TOML file: its real keys with random values, unknown keys, or malformed text."""

    def build() -> bytes:
        if data.draw(st.integers(0, 4), label="mix malformed") == 0:
            return data.draw(st.sampled_from(MALFORMED_TOML), label="malformed mix")
        source = st.dictionaries(st.sampled_from(["name", "path", "weight", "extra"]), TOML_VALUES, max_size=4)
        sources = st.one_of(st.lists(source, max_size=3), TOML_VALUES)
        keys = {"tokens": st.one_of(INTS, TEXT, TOML_VALUES), "output": TOML_VALUES, "seed": TOML_VALUES}
        keys |= {"max_repeats": st.one_of(FLOATS, TOML_VALUES), "source": sources, "extra": TOML_VALUES}
        tree = data.draw(st.fixed_dictionaries({}, optional=keys), label="mix config")
        return tomli_w.dumps(tree).encode()

    return build


@PROFILE
@given(data=st.data())
def test_mix(data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge mix [CONFIG.toml] --source NAME=FOLDER:WEIGHT ... --tokens N --output DIR [...]` and `--verify DIR`
    over folders that hold no token shards."""
    with sandbox(tmp_path) as folder:

        def source() -> str:
            name = data.draw(st.one_of(st.sampled_from(["web", "code", ""]), ARG_TEXT), label="source name")
            where = draw_path(data, folder, "source folder")
            weight = data.draw(st.one_of(NUMBER_TEXT, ARG_TEXT), label="weight")
            return data.draw(st.sampled_from([f"{name}={where}:{weight}", f"{name}={where}", where]), label="spec")

        tokens = st.one_of(NUMBER_TEXT, st.sampled_from(["10M", "2.5B", "1k", "1_000", "M", "", "1e3", "-5", "nanK"]))
        spec = {
            "--source": source,
            "--tokens": value(data, st.one_of(tokens, ARG_TEXT), "tokens"),
            "--output": path_arg(data, folder, "output"),
            "--seed": int_arg(data, "seed"),
            "--max-repeats": float_arg(data, "max repeats"),
            "--overwrite": switch,
            "--verify": lambda: draw_run_dir(data, folder, "pool"),
        }
        config = positionals(data, path_arg(data, folder, "config", mix_toml(data)))
        fuzz_command(data, capsys, ["mix"], [*config, *options(data, spec, ("--source", "--tokens", "--output"))])


@PROFILE
@given(argv=st.lists(ARG_TEXT, max_size=4))
def test_any_command_name(argv: list[str], capsys: pytest.CaptureFixture, quiet_env: None) -> None:
    """`lmforge ANYTHING ...`: an unknown command is one error line; `--help` prints the commands."""
    if argv and argv[0] in COMMANDS:
        return  # the command tests above cover real commands with real flags
    if not argv:
        # No command at all is answered with the list of commands, not an error line.
        code, out, _ = run_cli(argv, capsys)
        assert code == 2 and out.startswith("usage: lmforge COMMAND")
        return
    check(argv, capsys)


# ---------------------------------------------------------------------------------------------------------------
# Regressions: one fixed input per bug the fuzzing found


def error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The stderr of a command that must fail with exit code 2 and one error message."""
    code, _, err = check(argv, capsys)
    assert code == 2, err
    return err


@pytest.fixture
def base_toml(tmp_path: Path) -> str:
    """The valid base config, written into the test's tmp dir."""
    return write_base(tmp_path)


def test_config_file_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """`@ FOLDER` raised IsADirectoryError from open()."""
    assert f"config file {tmp_path} is a folder, not a TOML file" in error_line(["train", "@", str(tmp_path)], capsys)
    assert "config file . is a folder" in error_line(["train", "@", "", "--dry-run"], capsys)  # Path("") is "."


def test_config_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """A Latin-1 config file raised UnicodeDecodeError, which tomllib does not turn into a TOMLDecodeError."""
    path = tmp_path / "latin1.toml"
    path.write_bytes('output_dir = "caf\xe9"\n'.encode("latin-1"))
    err = error_line(["train", "@", str(path), "--dry-run"], capsys)
    assert f"{path}: not valid TOML: not UTF-8 text (byte 17)" in err


def test_config_file_with_a_huge_integer(tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """An integer of more than 4300 digits raised int()'s ValueError through tomllib."""
    path = tmp_path / "huge.toml"
    path.write_text("max_steps = " + "9" * 5000 + "\n")
    err = error_line(["train", "@", str(path), "--dry-run"], capsys)
    assert f"{path}: not valid TOML: Exceeds the limit (4300 digits)" in err
    assert "set_int_max_str_digits" not in err  # advice for programmers, not for the author of the file


def test_config_path_with_a_nul(capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """A NUL in an `@` path (possible through `main(argv)`, not through a shell) raised ValueError from open()."""
    assert "config file a\x00b.toml cannot be read: embedded null byte" in error_line(
        ["train", "@", "a\x00b.toml"], capsys
    )


def test_flag_value_with_a_huge_integer(base_toml: str, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """`--max-steps 999...` (5000 digits) raised int()'s ValueError from the flag parser; now the value stays a
    string, which the field refuses."""
    err = error_line(["train", "@", base_toml, "--max-steps", "9" * 5000, "--dry-run"], capsys)
    assert "max_steps (from the command line): Unable to parse input string as an integer" in err


def test_export_output_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """`--output FILE` raised NotADirectoryError from iterdir()."""
    (tmp_path / "taken").write_text("")
    err = error_line(["export", str(tmp_path / "run"), "--output", str(tmp_path / "taken")], capsys)
    assert f"--output {tmp_path / 'taken'}: exists and is not a folder" in err


@pytest.mark.parametrize("size", ["nan", "inf", "0", "-1", "1e-10"])
def test_export_max_shard_size(size: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """NaN and infinity raised from int(); sizes under one byte were refused by write_safetensors only after the
    checkpoint had loaded, with a traceback."""
    err = error_line(["export", str(tmp_path), "-o", str(tmp_path / "out"), "--max-shard-size", size], capsys)
    assert f"--max-shard-size {float(size)}: must be a finite number of GB" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"tokens = '\xff'\n", "not a readable TOML file: 'utf-8' codec"),
        (b"seed = " + b"9" * 5000, "Exceeds the limit"),
    ],
)
def test_mix_config_that_does_not_parse(
    text: bytes, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """A mix TOML file that is not UTF-8 raised UnicodeDecodeError, one with a 5000-digit integer ValueError."""
    path = tmp_path / "mix.toml"
    path.write_bytes(text)
    err = error_line(["mix", str(path)], capsys)
    assert f"{path}: " in err and expected in err and "set_int_max_str_digits" not in err


@pytest.mark.parametrize("command", ["plot", "report"])
def test_output_that_is_a_folder(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """An --output that is a folder raised IsADirectoryError from the final write."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss/mean": 2.0}\n{"step": 2, "loss/mean": 1.5}\n')
    taken = tmp_path / "taken.png"
    taken.mkdir()
    err = error_line([command, str(run), "-o", str(taken)], capsys)
    assert f"{taken}: Is a directory" in err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--max-new-tokens", "-1"], "--max-new-tokens -1: must be 0 or more"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--temperature", "nan"], "--temperature nan: must be 0 (greedy) or a finite number"),
        (["--temperature", "1e-300"], "--temperature 1e-300: must be 0 (greedy) or a finite number"),
        (["--seed", str(2**64)], f"--seed {2**64}: must fit in 64 bits"),
        (["--device", "tpu"], "--device 'tpu': Expected one of cpu, cuda"),
        (["--device", "meta"], "--device meta: not available here"),
        (["--prompt", "to be or not " * 8], "the prompt has"),
    ],
)
def test_sample_flags(
    flags: list[str], expected: str, tiny_model: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """Each of these raised once the model had loaded: ValueError from generate() (a bad count or top-p, a prompt
    longer than the context), RuntimeError from multinomial (NaN probabilities from a NaN or tiny temperature) or
    from torch.device, ValueError from manual_seed, and a meta-device model failed at its first forward."""
    assert expected in error_line(["sample", str(tiny_model), "--prompt", "to be", *flags], capsys)


def test_sample_runs_on_the_tiny_model(tiny_model: Path, capsys: pytest.CaptureFixture[str], quiet_env: None) -> None:
    """The happy path the flag checks must leave alone: greedy and sampled text from the tiny model."""
    for flags in (["--temperature", "0"], ["--temperature", "0.7", "--top-p", "0.9", "--seed", "-1"]):
        code, out, err = check(
            ["sample", str(tiny_model), "--prompt", "to be", "--max-new-tokens", "4", *flags], capsys
        )
        assert code == 0 and out.startswith("to be"), err


@pytest.mark.parametrize(
    ("flag", "expected"),
    [("--vocab-size", f"--vocab-size {2**64}: must be at most {2**24}"), ("--min-frequency", "must be below 2**64")],
)
def test_tokenizer_train_sizes_past_64_bits(
    flag: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """A vocabulary size or minimum frequency of 2**64 or more raised OverflowError from the BPE trainer."""
    (tmp_path / "a.txt").write_text("to be or not to be")
    argv = ["tokenizer", "train", str(tmp_path / "a.txt"), "--output", str(tmp_path / "tok"), flag, str(2**64)]
    assert expected in error_line(argv, capsys)


def test_tokenizer_train_vocab_size_that_aborted(tmp_path: Path, quiet_env: None) -> None:
    """`--vocab-size 2147483648` made the BPE trainer's up-front reservation fail, and Rust's out-of-memory handler
    aborts the process (SIGABRT, no Python exception). It runs in a child process, so that a regression fails this
    test instead of killing the whole test session."""
    (tmp_path / "a.txt").write_text("to be or not to be")
    argv = [
        "tokenizer",
        "train",
        str(tmp_path / "a.txt"),
        "--output",
        str(tmp_path / "tok"),
        "--vocab-size",
        str(2**31),
    ]
    done = subprocess.run([sys.executable, "-m", "lmforge", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"lmforge tokenizer train: error: --vocab-size {2**31}: must be at most {2**24}" in done.stderr


# Run directories and checkpoints that are not text, or that hold numbers Python cannot parse.


@pytest.mark.parametrize("command", ["plot", "report"])
def test_metrics_that_are_not_utf8(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """A metrics.jsonl that is not UTF-8 text is named, not a traceback."""
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss/mean": 2.0}\n\xff\n')
    assert "metrics.jsonl" in error_line([command, str(tmp_path), "-o", str(tmp_path / "out.png")], capsys)


@pytest.mark.parametrize("text", [b"a = '\xff'\n", b"a = " + b"9" * 5000])
def test_run_config_that_does_not_parse(
    text: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """A config.toml that is not UTF-8, or holds an integer of more than 4300 digits, is named."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss/mean": 2.0}\n')
    (tmp_path / "config.toml").write_bytes(text)
    assert "config.toml" in error_line(["report", str(tmp_path), "-o", str(tmp_path / "r.html")], capsys)


@pytest.mark.parametrize("layout", ["latest ²", "latest \\xb2", "step_² folder"])
def test_checkpoint_step_in_other_digits(
    layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    """Step numbers in digits that are not ASCII ('²', which str.isdigit accepts and int refuses), or a latest file
    that is not text: named, never a traceback."""
    root = tmp_path / "checkpoints"
    step = root / ("step_²" if layout == "step_² folder" else "step_1")
    step.mkdir(parents=True)
    for name in (".metadata", "trainer.json"):
        (step / name).write_text("{}")
    if layout != "step_² folder":
        (root / "latest").write_bytes("²".encode() if layout == "latest ²" else b"\xb2")
    assert "checkpoints" in error_line(["export", str(tmp_path), "-o", str(tmp_path / "out")], capsys)
