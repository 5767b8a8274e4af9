"""Security rules: files a user passes in are never unpickled beyond tensors, model weights come only from
safetensors, and names from the config cannot reach outside the folder they are joined to.

The first tests read the source of `src/lmforge` (AST and text), so a new `torch.load` or `pickle.load` is caught
where it is written; the others feed hostile files and names to the code that reads them."""

from __future__ import annotations

import ast
import io
import pickle
import random
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import lmforge
from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.checkpoint.layout import CheckpointError
from lmforge.checkpoint.load import load_checkpoint, load_model_state
from lmforge.checkpoint.rng_state import read_rng_state, rng_state, set_rng_state
from lmforge.checkpoint.safe_load import SafeLoadPlanner
from lmforge.config import ConfigError, load_train_config
from lmforge.config.ckpt import CkptConfig
from lmforge.config.hf_config import HFModelError
from lmforge.config.optim import AdamWConfig
from lmforge.hf.folder import load_pretrained, write_model_files
from lmforge.hf.weights import load_hf_weights
from lmforge.model import build_model
from lmforge.optim import build_optimizer
from lmforge.parallel.process_group import DistContext, init_distributed
from tests.conftest import tiny_llama
from tests.unit.test_config import BASE

SRC = Path(lmforge.__file__).parent
CPU = torch.device("cpu")

TORCH_LOAD_ALLOWED = {"checkpoint/rng_state.py", "checkpoint/safe_load.py"}
"""Files that may call `torch.load` at all (always with weights_only=True): a checkpoint's RNG states and the
non-tensor entries of its DCP files."""

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _sources() -> Iterator[tuple[str, str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        yield path.relative_to(SRC).as_posix(), text, ast.parse(text, filename=str(path))


def _dotted(node: ast.expr) -> str:
    """`a.b.c` for an attribute chain on a name, "" for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def test_source_tree_is_found() -> None:
    files = [name for name, _, _ in _sources()]
    assert "checkpoint/checkpointer.py" in files and "hf/weights.py" in files and len(files) > 50


def test_torch_load_only_with_weights_only_and_only_where_allowed() -> None:
    problems = []
    for name, _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
                problems += [
                    f"{name}:{node.lineno}: imports {a.name} from torch" for a in node.names if a.name == "load"
                ]
            if not isinstance(node, ast.Call) or _dotted(node.func) not in ("torch.load", "torch.serialization.load"):
                continue
            if name not in TORCH_LOAD_ALLOWED:
                problems.append(f"{name}:{node.lineno}: torch.load outside {sorted(TORCH_LOAD_ALLOWED)}")
            if not _keyword_is_true(node, "weights_only"):
                problems.append(f"{name}:{node.lineno}: torch.load without weights_only=True")
    assert not problems, "\n".join(problems)


def test_no_pickle_loads_and_no_remote_code() -> None:
    problems = []
    for name, text, tree in _sources():
        if "trust_remote_code" in text:
            problems.append(f"{name}: mentions trust_remote_code")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in PICKLE_MODULES:
                loaders = [a.name for a in node.names if a.name in ("load", "loads", "Unpickler")]
                problems += [f"{name}:{node.lineno}: imports {n} from {node.module}" for n in loaders]
            if not isinstance(node, ast.Call):
                continue
            func = _dotted(node.func)
            module, _, attr = func.rpartition(".")
            if module in PICKLE_MODULES and attr in ("load", "loads", "Unpickler", "open"):
                problems.append(f"{name}:{node.lineno}: {func}")
            if attr == "read_pickle" or _keyword_is_true(node, "allow_pickle"):
                problems.append(f"{name}:{node.lineno}: {func} unpickles")
    assert not problems, "\n".join(problems)


def test_model_weights_are_read_through_safetensors_only() -> None:
    for name, text, tree in _sources():
        if name not in ("hf/weights.py", "hf/folder.py"):
            continue
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & PICKLE_MODULES and "torch.load" not in text, name
    assert "safe_open(" in (SRC / "hf/weights.py").read_text(encoding="utf-8")


class _RunsCode:
    """Unpickling this calls `exec`, which would create the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def ctx() -> Iterator[DistContext]:
    yield init_distributed()


def _checkpoint(ctx: DistContext, run: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(tiny_llama(), 256, "sdpa", CPU)
    optimizer = build_optimizer(model, AdamWConfig(lr=1e-3))
    ckpt = Checkpointer(run, CkptConfig(), ctx, {})
    ckpt.save(1, model, optimizer, {"tokens_seen": 0, "schedule_start": 0, "data": {}})
    ckpt.close()
    return run / "checkpoints" / "step_1", model, optimizer


def test_rng_file_is_plain_tensors_and_values(ctx: DistContext, tmp_path: Path) -> None:
    path, _, _ = _checkpoint(ctx, tmp_path)
    rng = path / "rng" / "rank_0.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(rng) == []
    torch.load(rng, weights_only=True)  # loads with the restricted unpickler, no allowlist needed


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_rng_file_holding_a_pickled_object_is_refused_without_running_it(
    ctx: DistContext, tmp_path: Path, how: str
) -> None:
    path, model, optimizer = _checkpoint(ctx, tmp_path / "run")
    marker = tmp_path / "marker"
    rng = path / "rng" / "rank_0.pt"
    payload = {"torch": _RunsCode(marker)}
    if how == "torch.save":
        torch.save(payload, rng)
    else:
        rng.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, model, optimizer, rank=0)
    assert not marker.exists(), "unpickling ran the file's code"
    message = str(info.value)
    assert str(rng) in message and "refused" in message
    if how == "torch.save":
        assert "builtins.exec" in message  # named from the pickle opcodes, without building anything


def _draws() -> tuple[object, ...]:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(), torch.rand(3).tolist()


def _seed_all() -> None:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    random.gauss(0, 1), np.random.normal()  # leave a cached Gaussian in both, which the state must carry


def test_rng_states_restore_exactly(tmp_path: Path) -> None:
    _seed_all()
    torch.save(rng_state(), tmp_path / "new.pt")
    expected = _draws()
    set_rng_state(read_rng_state(tmp_path / "new.pt"))
    assert _draws() == expected


def test_rng_file_of_the_first_layout_still_restores(tmp_path: Path) -> None:
    # What checkpoints held before: the generators' own state objects, numpy's key as a uint32 array.
    _seed_all()
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    torch.save(old, tmp_path / "old.pt")
    expected = _draws()
    set_rng_state(read_rng_state(tmp_path / "old.pt"))
    assert _draws() == expected


def test_rng_file_that_is_not_one_is_named(tmp_path: Path) -> None:
    for name, content in [("junk.pt", b"not a checkpoint"), ("list.pt", None)]:
        path = tmp_path / name
        if content is None:
            torch.save([torch.zeros(2)], path)
        else:
            path.write_bytes(content)
        with pytest.raises(CheckpointError, match=rf"{name}: "):
            read_rng_state(path)


def _hf_folder_with_pickle_weights(folder: Path, marker: Path) -> Path:
    write_model_files(folder, tiny_llama(), 256, None)
    (folder / "pytorch_model.bin").write_bytes(
        pickle.dumps({"model.embed_tokens.weight": _RunsCode(marker)}, protocol=2)
    )
    return folder


def test_pickle_weights_are_refused_by_name(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    folder = _hf_folder_with_pickle_weights(tmp_path / "hf", marker)
    model = build_model(tiny_llama(), 256, "sdpa", CPU)
    for load in (lambda: load_pretrained(folder), lambda: load_hf_weights(model, folder)):
        with pytest.raises(HFModelError) as info:
            load()
        message = str(info.value)
        assert "pytorch_model.bin" in message and "safetensors" in message and "does not load" in message
    assert not marker.exists()


def _config_error(tmp_path: Path, *flags: str) -> str:
    base = tmp_path / "base.toml"
    base.write_text(BASE)
    with pytest.raises(ConfigError) as info:
        load_train_config(["@", str(base), *flags])
    return str(info.value)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/abs", "", "a\\b"])
def test_val_set_names_cannot_leave_the_run_directory(tmp_path: Path, name: str) -> None:
    quoted = '"' + name.replace("\\", "\\\\") + '"'  # a TOML string
    table = _config_error(tmp_path, "--val.sets", f"[{{name = {quoted}, path = 'x'}}]")
    assert "val.sets.0.name (from the command line)" in table
    listed = _config_error(tmp_path, "--val.sets", f'["ok", {quoted}]')
    assert "val.sets (from the command line): " in listed and "entry 1" in listed
    assert "plain name" in listed or "must not be empty" in listed


@pytest.mark.parametrize("field", ["project", "entity"])
@pytest.mark.parametrize("name", ["..", "../up", "/abs", "a/b", "", " "])
def test_wandb_names_that_are_path_parts_must_be_plain(tmp_path: Path, field: str, name: str) -> None:
    message = _config_error(tmp_path, f"--wandb.{field}", f'"{name}"')
    assert f"wandb.{field} (from the command line): " in message
    assert "plain name" in message or "must not be empty" in message


def test_plain_names_are_accepted(tmp_path: Path) -> None:
    base = tmp_path / "base.toml"
    base.write_text(BASE)
    sets = '[{name = "held-out.v2_1", path = "x"}, "quiz"]'
    flags = ["--val.sets", sets, "--val.data-dir", "evals", "--wandb.project", "my-proj.1"]
    config, _ = load_train_config(["@", str(base), *flags, "--wandb.name", "lr 3e-3 / warmup 10%"])
    assert config.val.sets[1] == "quiz" and config.wandb.project == "my-proj.1"
    assert config.wandb.name == "lr 3e-3 / warmup 10%"  # a display name, never a path: free text


def test_checkpoint_metadata_that_would_run_code_is_refused(ctx: DistContext, tmp_path: Path) -> None:
    path, model, optimizer = _checkpoint(ctx, tmp_path / "run")
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker), protocol=2))
    for load in (lambda: load_checkpoint(path, model, optimizer, rank=0), lambda: load_model_state(path, model)):
        with pytest.raises(
            CheckpointError, match=r"\.metadata: refused to load the checkpoint's metadata: (__)?builtin(s|__)\.exec"
        ):
            load()
    assert not marker.exists(), "unpickling ran the file's code"


def test_checkpoint_entries_load_with_the_restricted_unpickler(ctx: DistContext, tmp_path: Path) -> None:
    path, model, optimizer = _checkpoint(ctx, tmp_path / "run")
    load_checkpoint(path, model, optimizer, rank=0)  # a real checkpoint's metadata and entries pass
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save({"lr": _RunsCode(marker)}, buffer)
    buffer.seek(0)
    planner = SafeLoadPlanner()
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(CheckpointError, match=r"refused to load checkpoint entry optim\.param_groups\.0\.lr"):
        planner.load_bytes(item, buffer)  # type: ignore[arg-type]
    assert not marker.exists()
