"""Imports point one way: cli -> commands -> train -> eval -> runtime / parallel -> prep / viz -> data / model /
optim / monitor / launch -> config. Walks every module of the package (imports inside functions included, type-only
imports under `if TYPE_CHECKING:` left out) and fails on any import of a higher layer or a sideways one not allowed
below."""

from __future__ import annotations

import ast
from pathlib import Path

import lmforge

PACKAGE = Path(lmforge.__file__).parent

LAYERS: dict[str, int] = {
    "config": 0,
    "data": 1,
    "model": 1,
    "optim": 1,
    "monitor": 1,
    "launch": 1,
    "prep": 2,
    "viz": 2,
    "parallel": 3,
    "runtime": 3,
    "eval": 4,
    "train": 5,
    "commands": 6,
    "cli": 7,
    "__main__": 8,
}
"""Layer of each top-level part of the package; a module may import its own part and lower layers."""

CONFIG_MODULES = {"lmforge.model.config", "lmforge.model.hf_config"}
"""The architecture configs and the HF config.json reader live with the model but are part of the config layer:
`[model.arch]` is validated by them."""

SIDEWAYS = {("optim", "model"), ("runtime", "parallel")}
"""Imports between two parts of one layer that the design allows (optimizer groups follow the model's parameter
roles; checkpoint IO knows the process group). Any other sideways import is a failure."""


def _part(module: str) -> str:
    if module in CONFIG_MODULES:
        return "config"
    return module.split(".")[1] if module.count(".") else ""


def _layer(module: str) -> int:
    return LAYERS[_part(module)]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, imported lmforge module) of every import outside `if TYPE_CHECKING:` blocks."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("lmforge."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import: resolve against this module's package
                base = ".".join([*module.split(".")[:-node.level], node.module])
            if base.startswith("lmforge."):
                found.append((node.lineno, base))
            elif base == "lmforge":
                found.extend((node.lineno, f"lmforge.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "lmforge":
            continue
        for line, target in _imports(ast.parse(path.read_text(encoding="utf-8")), module):
            if _part(target) == _part(module):
                continue
            mine, theirs = _layer(module), _layer(target)
            sideways = mine == theirs and (_part(module), _part(target)) not in SIDEWAYS
            if theirs > mine or sideways:
                where = path.relative_to(PACKAGE.parent)
                problems.append(f"{where}:{line}: {module} (layer {mine}) imports {target} (layer {theirs})")
    return problems


def test_every_part_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "_"))}
    parts = {p for p in parts if (PACKAGE / p).is_dir() or (PACKAGE / f"{p}.py").is_file()} - {"py"}
    assert parts <= set(LAYERS), f"give these parts of the package a layer: {sorted(parts - set(LAYERS))}"


def test_imports_point_one_way() -> None:
    problems = _violations()
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    # The walk must find imports inside functions and skip type-only ones, or the test above proves nothing.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lmforge.train.trainer import Trainer\n"
        "def f():\n    from lmforge.commands.errors import fail\n"
    )
    found = _imports(ast.parse(source), "lmforge.data.example")
    assert found == [(5, "lmforge.commands.errors")]
    assert _layer(found[0][1]) > _layer("lmforge.data.example")
