"""The help generated from the config docstrings: `lmforge train --help [SECTION]` and docs/config.md's tables."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lmforge.config import TrainConfig
from lmforge.config.fields import field_rows, section_names
from lmforge.config.help import REGENERATE, USAGE, WIDTH, markdown_tables, train_help

DOC = Path(__file__).parents[2] / "docs" / "config.md"
BLOCK = re.compile(r"<!-- fields:([\w.]+) -->\n(.*?)\n?<!-- /fields:\1 -->", re.S)


def walk(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel], FieldInfo, bool]]:
    """(dotted path, owning class, field, holds a section) for every field under `model`, union variants included."""
    for attr, info in model.model_fields.items():
        path = prefix + (info.alias or attr)
        subs: list[tuple[type[BaseModel], str]] = []
        stack: list[tuple[Any, bool]] = [(info.annotation, False)]
        while stack:
            ann, in_list = stack.pop()
            if get_origin(ann) is Annotated:
                stack.append((get_args(ann)[0], in_list))
            elif isinstance(ann, type) and issubclass(ann, BaseModel):
                subs.append((ann, f"{path}[]." if in_list else f"{path}."))
            else:
                listy = get_origin(ann) in (list, tuple)
                stack.extend((arg, in_list or listy) for arg in get_args(ann))
        yield path, model, info, any(not p.endswith("[].") for _, p in subs)
        for sub, sub_prefix in subs:
            yield from walk(sub, sub_prefix)


def first_words(text: str, n: int = 5) -> str:
    return " ".join(text.split()[:n])


def flat(text: str) -> str:
    return " ".join(text.split())


def test_docs_tables_match_the_docstrings() -> None:
    text = DOC.read_text()
    blocks = {name: body for name, body in BLOCK.findall(text)}
    tables = markdown_tables()
    how = f"regenerate them with `{REGENERATE}`"
    assert not set(tables) - set(blocks), (
        f"docs/config.md has no <!-- fields:NAME --> block for {sorted(set(tables) - set(blocks))}: add the marker "
        f"pair where the table belongs, then {how}"
    )
    assert not set(blocks) - set(tables), f"docs/config.md marks unknown sections {sorted(set(blocks) - set(tables))}"
    stale = [name for name in tables if blocks[name] != tables[name]]
    assert not stale, f"the field tables of docs/config.md are out of date for {stale}; {how}"


def test_every_field_has_a_docstring() -> None:
    fields = list(walk(TrainConfig))
    assert len(fields) > 100  # the walk reached the union variants and nested sections
    missing = [f"{owner.__name__}.{path}" for path, owner, info, _ in fields if not (info.description or "").strip()]
    assert not missing, f"fields without a docstring: {missing}"
    assert all(row.doc for row in field_rows())


def test_full_help_lists_every_field_with_its_docstring() -> None:
    text = train_help(None)
    assert text.startswith(USAGE + "\n")
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    words = flat(text)
    absent = []
    for path, _owner, info, is_section in walk(TrainConfig):
        doc = flat(info.description or "")
        tag = get_args(info.annotation)[0] if get_origin(info.annotation) is Literal and ": " in doc else None
        if tag is not None and len(get_args(info.annotation)) == 1:
            # A variant's tag docstring ("Data type: random tokens ...") is merged into its section's tag row.
            label, rest = doc.split(": ", 1)
            wanted = [f"{label}: ", f'"{tag}" = {first_words(rest.rstrip("."), 4)}']
        else:
            wanted = [f"[{path}]" if is_section else path, first_words(doc)]
        absent += [f"{path}: {w!r}" for w in wanted if w not in words]
    assert not absent, "missing from `lmforge train --help`:\n" + "\n".join(absent)


def test_section_help_shows_only_that_section() -> None:
    data = train_help("data")
    for name in ("data.seq_len", "data.batch_tokens", "data.paths", "data.vocab_size", "data.loss_mask"):
        assert name in data
    for other in ("optim.lr", "[optim]", "model.init.std", "usage:"):
        assert other not in data
    assert '[data] type = "sft"' in data

    arch = train_help("model.arch")
    for name in ("model.arch.model_type", "model.arch.hidden_size", "model.arch.n_routed_experts"):
        assert name in arch
    assert '[model.arch] model_type = "qwen3_moe"' in arch
    assert "model.init.std" not in arch and "model.attn" not in arch

    model = train_help("model")
    assert "model.attn" in model and "model.init.std" in model and "model.arch.hidden_size" in model
    assert "data.batch_tokens" not in model and "[data]" not in model

    assert train_help("[eval-snapshots]") == train_help("eval_snapshots")
    assert "max_steps" in train_help("top") and "model.attn" not in train_help("top")


@pytest.mark.parametrize("name", ["nosuch", "model.nosuch", "data.seq_len"])
def test_unknown_section_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(name))) as info:
        train_help(name)
    assert "model.arch" in str(info.value) and "eval_snapshots" in str(info.value)


def test_rows_render_defaults_types_and_variants() -> None:
    rows = {(row.path, row.variant): row for row in field_rows()}
    assert rows["model.init.std", None].default == "0.02"
    assert rows["model.attn", None].default == '"auto"'
    assert rows["model.compile", None].default == "false"
    assert rows["data.seq_len", None].default == "required"
    assert rows["val.seq_lens", None].default == "[]"
    assert rows["resume.step", None].default == "unset"
    assert rows["optim.eps", None].default == "1e-8"
    assert rows["optim.type", None].default == '"muon"'  # the optimizer a config without optim.type gets
    assert rows["data.type", None].type == '"fake", "tokens" or "sft"'
    assert rows["model.init.scheme", None].type == '"normal" or "completep"'
    assert rows["schedule.warmup", None].type == "float >= 0, <= 1"
    assert ("ckpt.async", None) in rows  # fields are listed by the key a TOML file uses
    assert ("val.sets[].path", None) in rows
    # Shared fields once, each variant's own under its selector.
    assert [r.variant for r in field_rows("data") if r.path == "data.seq_len"] == [None]
    assert {r.variant for r in field_rows("data") if r.path == "data.paths"} == {'type = "tokens"', 'type = "sft"'}
    assert rows["model.arch.moe_intermediate_size", 'model_type = "glm4_moe"'].default == "required"
    assert rows["model.init.std", None].name == "std"
    assert field_rows("model.init") == [r for r in field_rows() if r.section == "model.init"]
    assert section_names()[0] == "top" and {"model.arch", "data", "optim", "val", "wandb"} <= set(section_names())
