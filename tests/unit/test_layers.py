"""Imports point one way, and nothing depends on itself.

The layers, top to bottom (a module may import its own part and any lower layer, nothing else):

    __main__ -> cli -> commands -> plan -> train -> eval -> hf -> checkpoint -> parallel -> optim / prep / viz
             -> data / model / monitor / launch -> config

Parts that share a layer never import each other. The walk reads every module of the package: imports inside
functions count, type-only imports under `if TYPE_CHECKING:` do not, and importing `lmforge.a.b.c` counts as
importing `lmforge.a` and `lmforge.a.b` too, since Python runs those packages' `__init__.py` first. There are no
exceptions to the order. A second check finds import cycles between modules (a package's `__init__.py`
re-exporting its own modules aside)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lmforge

PACKAGE = Path(lmforge.__file__).parent

LAYERS: dict[str, int] = {
    "config": 0,
    "data": 1,
    "model": 1,
    "monitor": 1,
    "launch": 1,
    "optim": 2,
    "prep": 2,
    "viz": 2,
    "parallel": 3,
    "checkpoint": 4,
    "hf": 5,
    "eval": 6,
    "train": 7,
    "plan": 8,
    "commands": 9,
    "cli": 10,
    "__main__": 11,
}
"""Layer of each top-level part of the package."""


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _layer(module: str) -> int:
    return LAYERS[_part(module)]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether `name` (lmforge.x.y) is a module or package of the source tree, not an attribute of one."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported lmforge module) of every import outside `if TYPE_CHECKING:` blocks; `from a import b` names
    the module `a.b` when b is a module, else `a`."""
    found: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("lmforge."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: `.` is this module's package, each further dot one package up
                above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*above, base] if base else above)
            if base == "lmforge" or base.startswith("lmforge."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.append((node.lineno, sub if _is_module(sub) else base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(line, target) for line, target in found if target != "lmforge"]


def _loaded(target: str) -> Iterator[str]:
    """The modules an import of `target` runs: its parent packages, then itself (lmforge's own __init__ aside)."""
    parts = target.split(".")
    for i in range(2, len(parts) + 1):
        yield ".".join(parts[:i])


def _sources() -> Iterator[tuple[str, Path, bool]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module != "lmforge":
            yield module, path, path.name == "__init__.py"


def _violations() -> list[str]:
    problems = []
    for module, path, is_package in _sources():
        for line, target in _imports(ast.parse(path.read_text(encoding="utf-8")), module, is_package):
            for loaded in _loaded(target):
                if _part(loaded) == _part(module):
                    continue
                mine, theirs = _layer(module), _layer(loaded)
                if theirs >= mine:
                    where = path.relative_to(PACKAGE.parent)
                    kind = "higher" if theirs > mine else "same"
                    problems.append(f"{where}:{line}: {module} (layer {mine}) imports {loaded} ({kind} layer {theirs})")
    return problems


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, without the edges from a package to its own modules (re-exports) and the
    implicit ones to parent packages."""
    graph: dict[str, set[str]] = {}
    for module, path, is_package in _sources():
        targets = {t for _, t in _imports(ast.parse(path.read_text(encoding="utf-8")), module, is_package)}
        graph[module] = {t for t in targets if t != module and not (is_package and t.startswith(module + "."))}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_part_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "_"))}
    parts = {p for p in parts if (PACKAGE / p).is_dir() or (PACKAGE / f"{p}.py").is_file()} - {"py"}
    assert parts <= set(LAYERS), f"give these parts of the package a layer: {sorted(parts - set(LAYERS))}"


def test_imports_point_one_way() -> None:
    problems = _violations()
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_no_module_imports_itself_through_others() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_what_they_forbid() -> None:
    # The walk must find imports inside functions, skip type-only ones and resolve submodules, or the tests above
    # prove nothing.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lmforge.train.trainer import Trainer\n"
        "def f():\n    from lmforge.commands.errors import fail\n"
        "from lmforge.model import llama, build_model\n"
        "from . import batch\n"
    )
    found = _imports(ast.parse(source), "lmforge.data.example")
    assert found == [(5, "lmforge.commands.errors"), (6, "lmforge.model.llama"), (6, "lmforge.model"),
                     (7, "lmforge.data.batch")]  # fmt: skip
    assert _layer(found[0][1]) > _layer("lmforge.data.example")
    # A deep import loads every package above the module: a carve-out for `lmforge.model.x` would still run
    # `lmforge/model/__init__.py`.
    assert list(_loaded("lmforge.train.callbacks.order")) == [
        "lmforge.train",
        "lmforge.train.callbacks",
        "lmforge.train.callbacks.order",
    ]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
