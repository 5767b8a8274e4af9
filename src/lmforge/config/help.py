"""Help text for `lmforge train`, generated from the config classes: every field's name, default, type and docstring.

The rows come from one walk over `TrainConfig` (`lmforge.config.fields`); the terminal help (`train_help`)
and the field tables of docs/config.md (`markdown_tables`) are both rendered from them, so neither can drift from
the code. Regenerate the tables after editing a docstring:

    python -m lmforge.config.help --write-docs docs/config.md
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

from lmforge.config.fields import (
    ROOT,
    ConfigSection,
    FieldRow,
    config_sections,
    normalize_section,
    section_names,
    select_sections,
    unknown_section,
)

WIDTH = 120
"""Column at which the terminal help wraps."""

USAGE = """\
usage: lmforge train [@ FILE.toml ...] [--section.field VALUE ...] [--no-section.flag]
                     [--overwrite] [--dry-run] [--help [SECTION]]

Config files are deep-merged left to right, then the flags apply (later wins). Run under torchrun for several
processes: torchrun --nproc-per-node 8 -m lmforge train @ run.toml"""
"""The usage paragraph at the top of `lmforge train --help`."""

REGENERATE = "python -m lmforge.config.help --write-docs docs/config.md"
"""The command that rewrites the generated blocks of docs/config.md."""

_BLOCK = re.compile(r"<!-- fields:(?P<name>[\w.]+) -->\n(?P<body>.*?)\n?<!-- /fields:(?P=name) -->", re.S)


# ---------------------------------------------------------------------------------------------------------------
# Terminal help


def _wrap(text: str, indent: str, first: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent if first is None else first,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _text_row(row: FieldRow) -> list[str]:
    head = f"  {row.path}" + (f"  ({row.default})" if row.default in ("required", "unset") else f" = {row.default}")
    head = head.ljust(46) + "  " + row.type
    lines = _wrap(head, " " * 48) if len(head) > WIDTH else [head.rstrip()]
    return lines + _wrap(row.doc, " " * 6)


def _heading(title: str, doc: str) -> list[str]:
    doc = doc[:1].upper() + doc[1:]
    return _wrap(f"{title}  {doc}", "    ", first="")


def _text_section(section: ConfigSection) -> list[str]:
    title = "top level (before any [section])" if section.name == ROOT else f"[{section.name}]"
    lines = _heading(title, section.doc)
    for row in section.rows_of(None):
        lines += _text_row(row)
    for variant in section.variants:
        lines += ["", *_heading(f"[{section.name}] {variant.selector}", variant.doc)]
        rows = section.rows_of(variant.selector)
        for row in rows:
            lines += _text_row(row)
        if not rows:
            lines.append("  (no fields of its own)")
    return lines


def train_help(section: str | None = None) -> str:
    """`lmforge train --help [SECTION]`: without a section, the usage and every section's fields; with one (`data`,
    `model.arch`, `optim`, ...), that section and its sub-sections only. Each field is shown as its dotted name, its
    default and type, then its docstring, wrapped at 120 columns. An unknown section raises ValueError."""
    parts: list[str] = []
    if section is None:
        about = (
            "Every field by section (`--help SECTION` shows one section): its dotted name, its default and the values "
            "it takes, then what it does. Set a field in a TOML file under its [section], or with --section.field "
            "VALUE. In [data], [optim] and [model.arch] a tag field (type, model_type) chooses the variant, and each "
            "variant adds the fields listed under it."
        )
        parts += [USAGE, "\n".join(_wrap(about, ""))]
    parts += ["\n".join(_text_section(s)) for s in select_sections(section)]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Markdown tables for docs/config.md


def _md_text(text: str) -> str:
    # Point docs/NAME.md references at the sibling page; docs/config.md lives in docs/ too.
    text = re.sub(r"\bdocs/([\w.-]+?\.md)(#[\w-]+)?", lambda m: f"[{m.group(1)}]({m.group(1)}{m.group(2) or ''})", text)
    return text.replace("|", "\\|")


def _md_table(rows: Iterable[FieldRow]) -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for row in rows:
        default = row.default if row.default in ("required", "unset") else f"`{row.default}`"
        meaning = f"{_md_text(row.doc)} Type: `{row.type}`."
        lines.append(f"| `{row.name}` | {_md_text(default)} | {meaning} |")
    return "\n".join(lines)


def markdown_table(section: str) -> str:
    """The markdown of one section (exactly that one, not its sub-sections): its field table, and for a union the
    shared table followed by one short paragraph and table per variant."""
    sec = {s.name: s for s in config_sections()}.get(normalize_section(section))
    if sec is None:
        raise unknown_section(section)
    if not sec.variants:
        return _md_table(sec.rows)
    tag = sec.rows[0].name
    blocks = [f"Every `{tag}` has:", _md_table(sec.rows_of(None))]
    for variant in sec.variants:
        rows = sec.rows_of(variant.selector)
        intro = f"`{variant.selector}`: {_md_text(variant.doc)}"
        blocks.append(intro + ("" if rows else " No fields of its own."))
        if rows:
            blocks.append(_md_table(rows))
    return "\n\n".join(blocks)


def markdown_tables() -> dict[str, str]:
    """Section name -> its generated markdown (see `markdown_table`), for every section."""
    return {s.name: markdown_table(s.name) for s in config_sections()}


def doc_blocks(text: str) -> dict[str, str]:
    """The generated blocks of a markdown page: `<!-- fields:NAME -->` ... `<!-- /fields:NAME -->` by NAME."""
    return {m.group("name"): m.group("body") for m in _BLOCK.finditer(text)}


def render_docs(text: str) -> str:
    """The page with every marked block replaced by the current `markdown_tables()`; a marker naming no section
    raises ValueError."""
    tables = markdown_tables()

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in tables:
            raise ValueError(f"<!-- fields:{name} --> names no config section; known sections: {', '.join(tables)}")
        return f"<!-- fields:{name} -->\n{tables[name]}\n<!-- /fields:{name} -->"

    return _BLOCK.sub(replace, text)


def write_docs(path: Path) -> list[str]:
    """Rewrite the marked blocks of a markdown file in place; returns the sections it has no block for."""
    text = path.read_text()
    new = render_docs(text)
    if new != text:
        path.write_text(new)
    return [name for name in section_names() if name not in doc_blocks(new)]


def main(argv: list[str] | None = None) -> int:
    """`python -m lmforge.config.help [SECTION]` prints the help; `--write-docs FILE` rewrites FILE's tables and
    `--check-docs FILE` only reports whether they are current."""
    parser = argparse.ArgumentParser(prog="python -m lmforge.config.help", description=main.__doc__)
    parser.add_argument("section", nargs="?", help="print only this section (and its sub-sections)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write-docs", type=Path, metavar="FILE", help="rewrite the <!-- fields:... --> blocks")
    group.add_argument("--check-docs", type=Path, metavar="FILE", help="exit 1 if those blocks are out of date")
    args = parser.parse_args(argv)
    if args.write_docs is not None or args.check_docs is not None:
        path: Path = args.write_docs or args.check_docs
        text = path.read_text()
        missing = [name for name in section_names() if name not in doc_blocks(text)]
        stale = render_docs(text) != text
        if args.write_docs is not None:
            missing = write_docs(path)
            print(f"{path}: {'rewrote the field tables' if stale else 'field tables already current'}")
        elif stale:
            print(f"{path}: field tables are out of date; run {REGENERATE}", file=sys.stderr)
        if missing:
            print(f"{path}: no <!-- fields:NAME --> block for: {', '.join(missing)}", file=sys.stderr)
        return 1 if missing or (stale and args.check_docs is not None) else 0
    try:
        sys.stdout.write(train_help(args.section))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
