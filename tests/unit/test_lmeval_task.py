"""`lmforge val-sets TASK.yaml`: lm-evaluation-harness task files with local data become eval set files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmforge.commands.val_sets import main as val_sets_main
from lmforge.eval.sets import read_eval_set
from lmforge.prep.lmeval_task import convert_task
from lmforge.prep.val_sets import ConvertError
from tests.chat import write_jsonl

HELLASWAG_LIKE = """\
task: tiny_hs
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
description: "Pick the ending.\\n"
doc_to_text: "{{{{ctx_a}}}} {{{{ctx_b | capitalize}}}}:"
doc_to_choice: endings
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _task(folder: Path, text: str, name: str = "task.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text, encoding="utf-8")
    return folder / name


def test_a_multiple_choice_task_becomes_a_ctxcont_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"ctx_a": "A man", "ctx_b": "sits down", "endings": ["and eats.", "and flies."], "label": "0"},
        {"ctx_a": "Ünïcode", "ctx_b": "works", "endings": ["yes", "no", "maybe"], "label": "2"},
    ]
    data = write_jsonl(tmp_path / "hs.jsonl", rows)
    task = _task(tmp_path / "tasks", HELLASWAG_LIKE.format(data=data))
    assert val_sets_main([str(task), "--output", str(tmp_path / "out")]) == 0
    assert "val-sets: 2 ctxcont items -> " in capsys.readouterr().out
    evs = read_eval_set(tmp_path / "out" / "tiny_hs.ctxcont.jsonl")
    got = [(i.context, i.continuations, i.label, i.target_delimiter) for i in evs.items]
    assert got == [
        ("Pick the ending.\nA man Sits down:", ("and eats.", "and flies."), 0, " "),
        ("Pick the ending.\nÜnïcode Works:", ("yes", "no", "maybe"), 2, " "),
    ]


def test_included_base_files_choice_templates_and_empty_prompts(tmp_path: Path) -> None:
    """A BLiMP-style task: `include` of a template, an empty prompt, choices from a list template, target 0."""
    data = write_jsonl(tmp_path / "blimp.jsonl", [{"sentence_good": "Cats run.", "sentence_bad": "Cats runs."}])
    _task(tmp_path / "tasks", 'output_type: multiple_choice\ndoc_to_text: ""\ndoc_to_target: 0\n'
          'doc_to_choice: "{{[sentence_good, sentence_bad]}}"\ntarget_delimiter: " "\n', "_template_yaml")  # fmt: skip
    task = _task(tmp_path / "tasks", f"include: _template_yaml\ntask: blimp_x\ndataset_kwargs:\n"
                 f"  data_files: {data}\n")  # fmt: skip
    name, kind, rows = convert_task(task)
    assert (name, kind) == ("blimp_x", "ctxcont")
    assert rows == [{"context": "", "continuations": ["Cats run.", "Cats runs."], "label": 0, "target_delimiter": " "}]


def test_a_rolling_task_becomes_a_ppl_set(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "wiki.jsonl", [{"page": "Héllo wörld.\n\nSecond line."}, {"page": "x"}])
    task = _task(tmp_path, "task: wiki\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: page\n")
    assert val_sets_main([str(task), "--data", str(data), "--output", str(tmp_path / "out"), "--name", "w"]) == 0
    assert read_eval_set(tmp_path / "out" / "w.ppl.jsonl").texts == ("Héllo wörld.\n\nSecond line.", "x")


def test_a_string_target_is_found_among_the_choices(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"q": "2+2=", "opts": ["3", "4"], "answer": "4"}])
    task = _task(tmp_path, "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: opts\ndoc_to_target: answer\n"
                 "target_delimiter: ''\n")  # fmt: skip
    assert convert_task(task, data)[2] == [{"context": "2+2=", "continuations": ["3", "4"], "label": 1,
                                            "target_delimiter": ""}]  # fmt: skip


@pytest.mark.parametrize(
    ("task", "row", "message"),
    [
        ("output_type: generate_until\ndoc_to_text: q\n", {"q": "a"}, "output_type 'generate_until': lmforge scores"),
        ("output_type: multiple_choice\ndoc_to_text: !function utils.doc_to_text\n", {"q": "a"},
         "doc_to_text is the Python function 'utils.doc_to_text'"),
        ("output_type: multiple_choice\nprocess_docs: !function utils.process\n", {"q": "a"},
         "'process_docs' is not supported: it runs Python"),
        ("output_type: multiple_choice\nnum_fewshot: 5\n", {"q": "a"}, "num_fewshot 5: lmforge converts zero-shot"),
        ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: t\n",
         {"q": "a", "c": ["x", "y"], "t": "z"}, r"line 1: the target 'z' is not one of the choices \['x', 'y'\]"),
        ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 5\n",
         {"q": "a", "c": ["x", "y"]}, r"line 1: the target 5 is not a choice index in \[0, 2\)"),
        ("output_type: multiple_choice\ndoc_to_text: '{{missing}}'\ndoc_to_choice: c\ndoc_to_target: 0\n",
         {"q": "a", "c": ["x", "y"]}, "line 1: doc_to_text '{{missing}}': 'missing' is undefined"),
        ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: '{{q}}'\ndoc_to_target: 0\n",
         {"q": "a", "c": ["x", "y"]}, "line 1: doc_to_choice gave 'a', not a Python list"),
        ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n",
         {"q": "a", "c": ["x", ""]}, "line 1: every choice must be a non-empty string"),
        ("output_type: multiple_choice\ndoc_to_text: '{{t}}'\ndoc_to_choice: c\ndoc_to_target: 0\n",
         {"t": "1", "c": ["x", "y"]}, "several inputs per row"),
        ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: '{{[0, 1]}}'\n",
         {"q": "a", "c": ["x", "y"]}, r"several right answers \(\[0, 1\]\)"),
        ("- a list\n", {"q": "a"}, "a task file is a YAML mapping, got list"),
        ("output_type: multiple_choice\ninclude: nowhere.yaml\n", {"q": "a"}, "nowhere.yaml: cannot be read"),
        ("output_type: [unclosed\n", {"q": "a"}, r"task\.yaml line 2, column 1: not valid YAML: expected .,. or .\]."),
        ("output_type: multiple_choice\nnum_fewshot: many\n", {"q": "a"}, "num_fewshot must be an integer, got 'many'"),
    ],
    ids=["generate", "function", "process_docs", "fewshot", "target-text", "target-index", "undefined", "not-a-list",
         "empty-choice", "multiple-input", "multiple-target", "not-a-mapping", "missing-include", "bad-yaml",
         "bad-type"],
)  # fmt: skip
def test_tasks_that_cannot_be_reproduced_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str, row: dict[str, object], message: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [row])
    path = _task(tmp_path, task)
    assert val_sets_main([str(path), "--data", str(data), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge val-sets: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_the_data_file_comes_from_the_task_or_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task = _task(tmp_path / "tasks", "output_type: loglikelihood_rolling\ndoc_to_target: text\ntest_split: test\n"
                 "dataset_kwargs:\n  data_files:\n    test: d.jsonl\n")  # fmt: skip
    with pytest.raises(ConvertError, match=r"d\.jsonl"):  # neither here nor beside the task
        convert_task(task)
    write_jsonl(tmp_path / "tasks" / "d.jsonl", [{"text": "beside the task"}])
    assert convert_task(task) == ("task", "ppl", [{"text": "beside the task"}])
    bare = _task(tmp_path, "output_type: loglikelihood_rolling\ndoc_to_target: text\n", "bare.yaml")
    with pytest.raises(ConvertError, match=r"no single local data file for split None .* pass --data"):
        convert_task(bare)
    out = str(tmp_path / "out")
    assert val_sets_main([str(bare), "--output", out, "--kind", "pairs"]) == 2
    assert "--kind is for row files" in capsys.readouterr().err
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"context": "a", "choices": ["x", "y"], "gold": 0}])
    assert val_sets_main([str(rows), "--output", out, "--data", str(rows), "--kind", "ctxcont"]) == 2
    assert "--data is for task files" in capsys.readouterr().err
    assert val_sets_main([str(rows), "--output", out]) == 2
    assert "--kind is required for a row file" in capsys.readouterr().err
    assert json.loads(json.dumps(convert_task(task)[2]))  # plain JSON rows
