"""The config's fields, walked once from `TrainConfig`: every field's dotted name, default, type and docstring,
grouped into sections (with the variants of `[data]`, `[optim]` and `[model.arch]`). `lmforge.config.help` renders
them as the terminal help of `lmforge train` and as the field tables of docs/config.md."""

from __future__ import annotations

import functools
import json
import re
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, Discriminator
from pydantic.fields import FieldInfo

from lmforge.config.train import TrainConfig

ROOT = "top"
"""Section name of the fields written before any `[section]` header (`max_steps`, `output_dir`)."""


@dataclass(frozen=True)
class FieldRow:
    """One config field, ready to print."""

    path: str
    """Dotted name as a flag takes it: `data.seq_len`, `model.init.std`, `max_steps`; the items of a list of tables
    are written `val.sets[].name`."""

    section: str
    """The section it belongs to: `data`, `model.init`, or `top` for the top-level fields."""

    default: str
    """The default as TOML (`"auto"`, `0.02`, `true`, `[]`), or `required`, or `unset` (None)."""

    type: str
    """The accepted values: `int > 0`, `"normal" or "completep"`, `list of str`, ..."""

    doc: str
    """The field's docstring on one line."""

    variant: str | None = None
    """For a field of one variant of a section: its selector, e.g. `type = "tokens"`; None for every other field."""

    @property
    def name(self) -> str:
        """The name inside its section (`seq_len`, `sets[].name`)."""
        return self.path if self.section == ROOT else self.path[len(self.section) + 1 :]


@dataclass(frozen=True)
class Variant:
    """One alternative of a section that is a union chosen by a tag field, e.g. `[data]` with `type = "sft"`."""

    selector: str
    """The tag as it is written: `type = "sft"`."""

    doc: str
    """What this variant is (its class docstring)."""


@dataclass(frozen=True)
class ConfigSection:
    """A TOML table of the config and its own fields (those of its sub-tables are in sections of their own)."""

    name: str
    """Dotted name (`model.arch`), or `top` for the top-level fields."""

    doc: str
    """The docstring of the field that holds the section (for `top`, the docstring of `TrainConfig`)."""

    rows: tuple[FieldRow, ...]
    """The fields: for a union, its tag field and the fields every variant shares, then each variant's own."""

    variants: tuple[Variant, ...] = ()
    """The alternatives of a union section, in declaration order; empty for a plain section."""

    def rows_of(self, variant: str | None) -> list[FieldRow]:
        """The rows of one variant (by selector), or with None the rows every variant has."""
        return [row for row in self.rows if row.variant == variant]


# ---------------------------------------------------------------------------------------------------------------
# Rendering values and types


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def toml_value(value: Any) -> str:
    """A default as TOML-like text: `"auto"`, `0.02`, `1e-8`, `true`, `[]`; None is `unset`."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, BaseModel):
        return toml_value(value.model_dump(mode="json", by_alias=True, exclude_none=True))
    return str(value)


def _strip_annotated(ann: Any) -> Any:
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    return ann


def _is_union(ann: Any) -> bool:
    return get_origin(ann) in (Union, types.UnionType)


def _join(alternatives: list[str]) -> str:
    alternatives = list(dict.fromkeys(alternatives))
    if len(alternatives) <= 1:
        return "".join(alternatives)
    return ", ".join(alternatives[:-1]) + " or " + alternatives[-1]


def _alternatives(ann: Any) -> list[str]:
    ann = _strip_annotated(ann)
    origin = get_origin(ann)
    if _is_union(ann):
        return [alt for arg in get_args(ann) if arg is not type(None) for alt in _alternatives(arg)]
    if origin is Literal:
        return [toml_value(v) for v in get_args(ann)]
    if origin in (list, tuple, set, frozenset):
        args = get_args(ann)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return ["[" + ", ".join(_join(_alternatives(a)) for a in args) + "]"]
        return ["list of " + (_join(_alternatives(args[0])) if args else "values")]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ["table"]
    if ann is Any:
        return ["any value"]
    return [getattr(ann, "__name__", str(ann))]


def _constraints(info: FieldInfo) -> list[str]:
    bounds: list[str] = []
    others: list[str] = []
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Gt):
            bounds.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Ge):
            bounds.append(f">= {meta.ge}")
        elif isinstance(meta, annotated_types.Lt):
            bounds.append(f"< {meta.lt}")
        elif isinstance(meta, annotated_types.Le):
            bounds.append(f"<= {meta.le}")
        elif isinstance(meta, annotated_types.MinLen) and meta.min_length:
            others.append("non-empty" if meta.min_length == 1 else f"at least {meta.min_length} items")
        elif isinstance(meta, annotated_types.MaxLen):
            others.append(f"at most {meta.max_length} items")
        elif getattr(meta, "pattern", None):
            others.append(f"matching {meta.pattern}")
    return [", ".join(bounds)] * bool(bounds) + others


def type_text(info: FieldInfo) -> str:
    """The values a field accepts, e.g. `int > 0`, `float >= 0, < 1`, `"flash", "sdpa" or "auto"`."""
    text = _join(_alternatives(info.annotation))
    cons = _constraints(info)
    if cons and cons[0][0] in "<>":
        text += " " + cons.pop(0)
    return ", ".join([text, *cons])


def _default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    return toml_value(info.get_default(call_default_factory=True, validated_data={}))


# ---------------------------------------------------------------------------------------------------------------
# Walking the config classes


def _section_class(ann: Any) -> type[BaseModel] | None:
    ann = _strip_annotated(ann)
    if _is_union(ann):
        args = [a for a in get_args(ann) if a is not type(None)]
        return _section_class(args[0]) if len(args) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _union_variants(info: FieldInfo) -> tuple[list[type[BaseModel]], str | Discriminator] | None:
    """The variant classes and the discriminator of a field holding a tagged union of sections, else None."""
    found: str | Discriminator | None = info.discriminator
    found = found or next((m for m in info.metadata if isinstance(m, Discriminator)), None)
    ann = info.annotation
    while True:
        if get_origin(ann) is Annotated:
            for meta in get_args(ann)[1:]:
                if isinstance(meta, FieldInfo) and meta.discriminator is not None:
                    found = found or meta.discriminator
                elif isinstance(meta, Discriminator):
                    found = found or meta
            ann = get_args(ann)[0]
        elif _is_union(ann):
            args = [a for a in get_args(ann) if a is not type(None)]
            if len(args) != 1:
                break
            ann = args[0]
        else:
            return None
    classes = [_strip_annotated(a) for a in get_args(ann) if a is not type(None)]
    if found is None or not all(isinstance(c, type) and issubclass(c, BaseModel) for c in classes):
        return None
    return classes, found


def _tag_name(classes: list[type[BaseModel]], disc: str | Discriminator) -> str:
    if isinstance(disc, str):
        return disc
    if isinstance(disc.discriminator, str):
        return disc.discriminator
    for name in classes[0].model_fields:
        if all(name in c.model_fields and get_origin(c.model_fields[name].annotation) is Literal for c in classes):
            return name
    raise TypeError(f"cannot tell the tag field of {[c.__name__ for c in classes]}")


def _tag_default(disc: str | Discriminator) -> str:
    # A callable discriminator may pick a variant when the tag is left out (the optimizer defaults to muon).
    if isinstance(disc, Discriminator) and callable(disc.discriminator):
        try:
            return toml_value(disc.discriminator({}))
        except Exception:  # a discriminator that cannot choose without the tag
            return "required"
    return "required"


def _variant_doc(cls: type[BaseModel]) -> str:
    # Section classes start their docstring with the selector (`data.type = "sft"`: ...); the heading shows it.
    return re.sub(r"^`[^`]*`:\s*", "", _one_line(cls.__doc__))


def _tag_doc(tag_docs: list[tuple[str, str]]) -> str:
    """One description of a tag field from each variant's: a label they all start with ("Data type: ") is said once."""
    labels = {doc.split(": ", 1)[0] for _, doc in tag_docs if ": " in doc}
    if len(labels) == 1 and all(": " in doc for _, doc in tag_docs):
        label = labels.pop()
        parts = [f"{value} = {doc.split(': ', 1)[1].rstrip('.')}" for value, doc in tag_docs]
        return f"{label}: " + "; ".join(parts) + "."
    return " ".join(f"{value}: {doc}" for value, doc in tag_docs)


def _field_rows(cls: type[BaseModel], section: str, prefix: str, skip: str | None = None) -> list[FieldRow]:
    """The leaf fields of one section class; a list of tables adds its items' fields as `name[].field`."""
    rows: list[FieldRow] = []
    for attr, info in cls.model_fields.items():
        name = info.alias or attr
        if name == skip or _section_class(info.annotation) is not None or _union_variants(info) is not None:
            continue
        path = f"{prefix}{name}"
        rows.append(FieldRow(path, section, _default_text(info), type_text(info), _one_line(info.description)))
        items = [_strip_annotated(a) for a in get_args(_strip_annotated(info.annotation))]
        for item in items:
            for alt in map(_strip_annotated, get_args(item) if _is_union(item) else (item,)):
                if isinstance(alt, type) and issubclass(alt, BaseModel):
                    # tables of a union share fields (`name`): the first member's row documents them
                    seen = {r.path for r in rows}
                    rows.extend(r for r in _field_rows(alt, section, f"{path}[].") if r.path not in seen)
    return rows


def _shared_subsections(classes: list[type[BaseModel]]) -> list[tuple[str, str, type[BaseModel]]]:
    """(name, docstring, class) of the sub-sections inside union variants: each must be in every variant, with one
    class (as `rope_scaling` is in every architecture), so that it documents as one section whatever the tag."""
    found: dict[str, set[type[BaseModel] | None]] = {}
    docs: dict[str, str] = {}
    for cls in classes:
        for attr, info in cls.model_fields.items():
            if _section_class(info.annotation) or _union_variants(info):
                found.setdefault(attr, set()).add(_section_class(info.annotation))
                docs[attr] = _one_line(info.description)
    shared = []
    for attr, subs in found.items():
        sub = next(iter(subs))
        if len(subs) != 1 or sub is None or not all(attr in cls.model_fields for cls in classes):
            raise TypeError(f"{attr}: a sub-section inside union variants must be one section class in every variant")
        shared.append((attr, docs[attr], sub))
    return shared


def _union_section(name: str, doc: str, classes: list[type[BaseModel]], disc: str | Discriminator) -> ConfigSection:
    tag = _tag_name(classes, disc)
    prefix = f"{name}."
    values = [get_args(c.model_fields[tag].annotation)[0] for c in classes]
    per_variant = [_field_rows(c, name, prefix, skip=tag) for c in classes]
    _shared_subsections(classes)  # sub-sections are walked by the caller; here only checked
    first = per_variant[0]
    shared = [row for row in first if all(row in rows for rows in per_variant[1:])]
    tag_docs = [
        (toml_value(v), _one_line(c.model_fields[tag].description)) for v, c in zip(values, classes, strict=True)
    ]
    tag_row = FieldRow(
        prefix + tag, name, _tag_default(disc), _join([toml_value(v) for v in values]), _tag_doc(tag_docs)
    )
    rows = [tag_row, *shared]
    variants: list[Variant] = []
    for value, cls, own in zip(values, classes, per_variant, strict=True):
        selector = f"{tag} = {toml_value(value)}"
        variants.append(Variant(selector, _variant_doc(cls)))
        rows += [FieldRow(r.path, r.section, r.default, r.type, r.doc, selector) for r in own if r not in shared]
    return ConfigSection(name, doc, tuple(rows), tuple(variants))


def _walk(cls: type[BaseModel], name: str, doc: str) -> list[ConfigSection]:
    prefix = "" if name == ROOT else f"{name}."
    own = ConfigSection(name, doc, tuple(_field_rows(cls, name, prefix)))
    nested: list[ConfigSection] = []
    for attr, info in cls.model_fields.items():
        child = prefix + (info.alias or attr)
        child_doc = _one_line(info.description)
        union = _union_variants(info)
        if union is not None:
            nested.append(_union_section(child, child_doc, *union))
            for sub_name, sub_doc, sub in _shared_subsections(union[0]):
                nested.extend(_walk(sub, f"{child}.{sub_name}", sub_doc))
        elif (sub := _section_class(info.annotation)) is not None:
            nested.extend(_walk(sub, child, child_doc))
    return [own, *nested]


@functools.cache
def config_sections() -> tuple[ConfigSection, ...]:
    """Every section of `TrainConfig`, parents before their sub-sections, in field order (`top` first)."""
    return tuple(_walk(TrainConfig, ROOT, _one_line(TrainConfig.__doc__)))


def section_names() -> list[str]:
    """The names `train_help` and `field_rows` accept: `top`, `model`, `model.arch`, `data`, ..."""
    return [s.name for s in config_sections()]


def normalize_section(section: str) -> str:
    """A section name as the user may write it (`[data]`, `eval-snapshots`, empty for the top level) in the form
    the sections are named."""
    name = section.strip().strip("[]").strip().replace("-", "_")
    return ROOT if name in ("", ROOT) else name


def select_sections(section: str | None = None) -> list[ConfigSection]:
    """All sections, or the one named and those nested in it (`model` includes `model.init`).

    Dashes may stand for underscores and the name may be written `[data]`. An unknown name raises ValueError
    naming it and listing the known sections."""
    every = list(config_sections())
    if section is None:
        return every
    name = normalize_section(section)
    chosen = [s for s in every if s.name == name or (name != ROOT and s.name.startswith(name + "."))]
    if not chosen:
        raise unknown_section(section)
    return chosen


def unknown_section(section: str) -> ValueError:
    """The error for a section name that does not exist: it names it, says where a field of that name is listed,
    and lists the known sections."""
    name = normalize_section(section)
    hint = ""
    if any(row.path == name for row in field_rows()):
        hint = f" ({name} is a field; --help {name.rsplit('.', 1)[0] if '.' in name else ROOT} lists it)"
    return ValueError(f"unknown config section {section!r}{hint}; known sections: {', '.join(section_names())}")


def field_rows(section: str | None = None) -> list[FieldRow]:
    """Every field of the config, or of one section and its sub-sections, in the order the help lists them."""
    return [row for s in select_sections(section) for row in s.rows]
