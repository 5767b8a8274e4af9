"""An lm-evaluation-harness task file plus its local data -> an eval set file (`lmforge val-sets TASK.yaml`).

The harness describes a task in YAML: `output_type`, how a row becomes the prompt (`doc_to_text`), the choices
(`doc_to_choice`), the answer (`doc_to_target`), the `target_delimiter` between prompt and answer (a space by
default) and a `description` in front of every prompt. Each `doc_to_*` is a field name of the data or a Jinja
template over the row's fields, read the way the harness 0.4 reads them:

- a `doc_to_text` or `doc_to_target` that names a field gives that field's value; otherwise the template is
  rendered, and a result of digits only (with `doc_to_choice` set) is an index;
- a `doc_to_choice` that names a field gives its list; a template must render to a Python list literal
  (`"{{[sentence_good, sentence_bad]}}"`); a YAML list is the choices themselves;
- a target that is a string must be one of the choices.

`output_type: multiple_choice` becomes a `ctxcont` set (`context` = description + prompt, `continuations` = the
choices, `label`, `target_delimiter`); `loglikelihood_rolling` becomes a `ppl` set whose texts are `doc_to_target`.
Scored with `val.convention = "lmeval"`, the set gives the harness's zero-shot numbers.

`include:` merges a base file (relative to the including one) under the task's own keys, as the harness does. What
the harness runs as Python (`!function`, `process_docs`), few-shot prompts, `gen_prefix`, tasks with several
inputs per row and tasks with several right answers cannot be reproduced here: each is refused by name, and
nothing is written.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jinja2 import StrictUndefined, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmforge.data.records import Record, RecordError, read_records
from lmforge.prep.val_sets import ConvertError, ValSetFile, check_set_name, write_rows

OUTPUT_KINDS = {"multiple_choice": "ctxcont", "loglikelihood_rolling": "ppl"}
"""The harness output types a task may have, and the kind of set each becomes."""
DEFAULT_TARGET_DELIMITER = " "
"""The harness's `target_delimiter` when a task does not set one."""
_UNSUPPORTED = {
    "process_docs": "it runs Python on the rows; apply it to the data file first",
    "use_prompt": "promptsource prompts are not read",
    "gen_prefix": "a prompt suffix for chat templates is not reproduced",
}


@dataclass(frozen=True)
class FunctionRef:
    """A `!function module.name` value: Python code the harness would import, which lmforge does not run."""

    name: str


class _TaskLoader(yaml.SafeLoader):
    """Safe YAML with the harness's `!function` tag read as a `FunctionRef`."""


_TaskLoader.add_constructor("!function", lambda loader, node: FunctionRef(str(loader.construct_scalar(node))))


def load_task(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The task's settings: the YAML file, with the file named by its `include:` merged under its own keys."""
    path = Path(path)
    if path.resolve() in _seen:
        raise ConvertError(f"{path}: includes itself (through {' -> '.join(str(p) for p in _seen)})")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConvertError(f"{path}: cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConvertError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        task = yaml.load(text, Loader=_TaskLoader)  # a SafeLoader subclass: no Python objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConvertError(f"{path}{where}: not valid YAML: {problem}") from None
    if not isinstance(task, dict):
        raise ConvertError(f"{path}: a task file is a YAML mapping, got {type(task).__name__}")
    include = task.pop("include", None)
    if include is None:
        return task
    if not isinstance(include, str):
        raise ConvertError(f"{path}: 'include' must be a file name, got {include!r}")
    base = load_task(path.parent / include, (*_seen, path.resolve()))
    return {**base, **task}


_TYPES: dict[str, tuple[type, ...]] = {
    "output_type": (str,),
    "task": (str, int),
    "num_fewshot": (int,),
    "dataset_kwargs": (dict,),
    "test_split": (str,),
    "validation_split": (str,),
    "target_delimiter": (str,),
    "description": (str,),
}


def check_types(task: dict[str, Any], where: Path) -> None:
    """Raise ConvertError naming the first task field whose value has a type the harness does not take there."""
    for key, types in _TYPES.items():
        value = task.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            expected = " or ".join({str: "a string", int: "an integer", dict: "a mapping"}[t] for t in types)
            raise ConvertError(f"{where}: {key} must be {expected}, got {value!r}")


def task_data_file(task: dict[str, Any], task_path: Path) -> Path:
    """The local data file of the split the harness evaluates (`test_split`, else `validation_split`), from
    `dataset_kwargs.data_files`; relative names are taken from the task file's folder when they are not found
    from the working directory."""
    split = task.get("test_split") or task.get("validation_split")
    files = (task.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        files = files.get(split)
    if isinstance(files, list) and len(files) == 1:
        files = files[0]
    if not isinstance(files, str):
        raise ConvertError(
            f"{task_path}: no single local data file for split {split!r} in dataset_kwargs.data_files; pass --data"
        )
    path = Path(files)
    if not path.exists() and not path.is_absolute() and (task_path.parent / path).exists():
        path = task_path.parent / path
    return path


class _Task:
    """One task's `doc_to_*` rules, applied to rows."""

    def __init__(self, task: dict[str, Any], where: Path, features: set[str]) -> None:
        self.task, self.where, self.features = task, where, features
        self.env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
        self.env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
        output = task.get("output_type")
        if output not in OUTPUT_KINDS:
            raise ConvertError(
                f"{where}: output_type {output!r}: lmforge scores {' and '.join(OUTPUT_KINDS)} tasks "
                "(log-likelihood of given texts, no generation)"
            )
        self.kind = OUTPUT_KINDS[output]
        for key, why in _UNSUPPORTED.items():
            if task.get(key) is not None:
                raise ConvertError(f"{where}: {key!r} is not supported: {why}")
        if (task.get("num_fewshot") or 0) > 0:
            raise ConvertError(f"{where}: num_fewshot {task['num_fewshot']}: lmforge converts zero-shot tasks only")
        for key in ("doc_to_text", "doc_to_choice", "doc_to_target", "description"):
            if isinstance(task.get(key), FunctionRef):
                raise ConvertError(
                    f"{where}: {key} is the Python function {task[key].name!r}, which lmforge does not run; write it "
                    "as a field name or a Jinja template"
                )
        self.delimiter = task.get("target_delimiter", DEFAULT_TARGET_DELIMITER)

    def render(self, template: str, record: Record, key: str) -> str:
        try:
            return self.env.from_string(template).render(**record.data)
        except TemplateError as e:
            raise ConvertError(f"{record.where()}: {key} {template!r}: {e}") from None

    def _value(self, key: str, record: Record) -> Any:
        spec = self.task.get(key)
        if isinstance(spec, str) and spec in self.features:
            return record.data.get(spec)
        if isinstance(spec, str):
            text = self.render(spec, record, key)
            if key != "description" and text.isdigit() and self.task.get("doc_to_choice") is not None:
                return int(text)
            if key == "doc_to_target" and len(text) >= 2 and text[0] == "[" and text[-1] == "]":
                try:
                    return ast.literal_eval(text)
                except (SyntaxError, ValueError):
                    return text
            return text
        return spec

    def choices(self, record: Record) -> list[str]:
        spec = self.task.get("doc_to_choice")
        if isinstance(spec, str) and spec in self.features:
            value = record.data.get(spec)
        elif isinstance(spec, str):
            text = self.render(spec, record, "doc_to_choice")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                raise ConvertError(f"{record.where()}: doc_to_choice gave {text!r}, not a Python list") from None
        elif isinstance(spec, dict):
            value = list(spec.values())
        else:
            value = spec
        if not isinstance(value, list | tuple) or len(value) < 2:
            raise ConvertError(f"{record.where()}: doc_to_choice must give a list of at least 2 choices, got {value!r}")
        if not all(isinstance(c, str) and c for c in value):
            raise ConvertError(f"{record.where()}: every choice must be a non-empty string, got {list(value)!r}")
        return list(value)

    def row(self, record: Record) -> dict[str, Any]:
        """The eval set row of one data row."""
        target = self._value("doc_to_target", record)
        if self.kind == "ppl":
            if not isinstance(target, str):
                raise ConvertError(f"{record.where()}: doc_to_target must give the text to score, got {target!r}")
            return {"text": target}
        text = self._value("doc_to_text", record)
        if not isinstance(text, str):
            raise ConvertError(
                f"{record.where()}: doc_to_text gave {text!r}; tasks whose prompt is an index into the choices "
                "(several inputs per row) are not supported"
            )
        description = self._value("description", record) or ""
        choices = self.choices(record)
        if isinstance(target, str):
            if target not in choices:
                raise ConvertError(f"{record.where()}: the target {target!r} is not one of the choices {choices!r}")
            target = choices.index(target)
        if isinstance(target, list):
            raise ConvertError(f"{record.where()}: several right answers ({target!r}) are not supported")
        if not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < len(choices):
            raise ConvertError(f"{record.where()}: the target {target!r} is not a choice index in [0, {len(choices)})")
        return {
            "context": str(description) + text,
            "continuations": choices,
            "label": target,
            "target_delimiter": self.delimiter,
        }


def convert_task(task_path: Path, data: Path | None = None) -> tuple[str, str, list[dict[str, Any]]]:
    """(task name, set kind, rows) of a harness task file and its data (`data`, else the task's local
    `dataset_kwargs.data_files`)."""
    task = load_task(task_path)
    check_types(task, task_path)
    data = data if data is not None else task_data_file(task, task_path)
    try:
        records = list(read_records([data]))
    except RecordError as e:
        raise ConvertError(str(e)) from None
    if not records:
        raise ConvertError(f"{data}: no rows")
    features = {k for r in records for k in r.data}
    rules = _Task(task, task_path, features)
    name = task.get("task")
    return str(name) if name is not None else task_path.stem, rules.kind, [rules.row(r) for r in records]


def write_task_set(task_path: Path, output: Path, data: Path | None = None, name: str | None = None) -> ValSetFile:
    """Convert a harness task (see `convert_task`) and write it to `output/NAME.KIND.jsonl`; NAME defaults to the
    task's `task` name. Nothing is written when any row fails."""
    task_name, kind, rows = convert_task(task_path, data)
    return write_rows(rows, kind, output, check_set_name(name or task_name))
