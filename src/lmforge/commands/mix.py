"""`lmforge mix`: write a data mixture, one token pool drawn from several shard folders in chosen shares.

    lmforge mix --source web=data/web:60 --source code=data/code:30 --source math=data/math:10 \\
        --tokens 10M --output data/mix [--seed S] [--max-repeats R] [--overwrite]
    lmforge mix mix.toml [--tokens N] [--output DIR] [--seed S] [--max-repeats R] [--overwrite]
    lmforge mix --verify DIR

The work is `lmforge.prep.mix.mix_sources` and `lmforge.prep.mix_verify.verify_mix`; this module turns flags or a
TOML file into their arguments, prints the per-source table, and reports bad input as one line (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.data.mixture import MixError, MixManifest
from lmforge.data.shards import ShardError
from lmforge.prep.mix import SourceSpec, mix_sources
from lmforge.prep.mix_verify import verify_mix

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_CONFIG_KEYS = {"tokens", "output", "seed", "max_repeats", "source"}
_SOURCE_KEYS = {"name", "path", "weight"}


def parse_token_count(text: str) -> int:
    """A token count: `1000000`, `1_000_000`, or a number with a suffix k, M, B or T (`10M`, `2.5B`); the result
    must be a whole number. `MixError` otherwise."""
    raw = text.strip().replace("_", "")
    scale = _SUFFIXES.get(raw[-1:].lower(), 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = Decimal(number) * scale
    except InvalidOperation:
        raise MixError(f"--tokens {text!r}: expected a whole number such as 5000000, 5_000_000, 5M or 2.5B") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise MixError(f"--tokens {text!r}: not a whole number of tokens")
    return int(value)


def parse_source(text: str) -> SourceSpec:
    """`NAME=FOLDER:WEIGHT` as a source (the folder may hold ':'; the weight follows the last one)."""
    name, eq, rest = text.partition("=")
    folder, colon, weight = rest.rpartition(":")
    if not eq or not colon or not name or not folder:
        raise MixError(f"--source {text!r}: expected NAME=FOLDER:WEIGHT, e.g. web=data/web:0.6")
    try:
        value = float(weight)
    except ValueError:
        raise MixError(f"--source {text!r}: weight {weight!r} is not a number") from None
    return SourceSpec(name, folder, value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MixError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _source_table(table: Any, where: str) -> SourceSpec:
    if not isinstance(table, dict):
        raise MixError(f"{where}: expected a table with name, path and weight")
    if set(table) != _SOURCE_KEYS:
        raise MixError(f"{where}: expected the keys name, path and weight, got {sorted(table)}")
    name, path = table["name"], table["path"]
    if not isinstance(name, str) or not isinstance(path, str):
        raise MixError(f"{where}: name and path must be strings")
    return SourceSpec(name, path, _number(table["weight"], f"{where}.weight"))


def read_config(path: Path) -> dict[str, Any]:
    """The settings of a mix TOML file: `tokens`, `output`, `seed`, `max_repeats` where given, and `sources` from
    its `[[source]]` tables. `MixError` naming the file and key for anything else."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise MixError(f"config file {path} does not exist") from None
    except (OSError, ValueError) as e:
        # ValueError: TOMLDecodeError, bytes that are not UTF-8, an integer beyond int()'s 4300 digits, a NUL in the
        # path. int()'s advice after the ';' is meant for programmers.
        raise MixError(f"{path}: not a readable TOML file: {str(e).split(';')[0]}") from None
    unknown = sorted(set(data) - _CONFIG_KEYS)
    if unknown:
        raise MixError(f"{path}: unknown keys {unknown}; a mix config holds {sorted(_CONFIG_KEYS)}")
    settings: dict[str, Any] = {}
    if "tokens" in data:
        tokens = data["tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int | str):
            raise MixError(f"{path}: tokens must be an integer or a string such as '10M'")
        settings["tokens"] = tokens if isinstance(tokens, int) else parse_token_count(tokens)
    if "output" in data:
        if not isinstance(data["output"], str):
            raise MixError(f"{path}: output must be a string")
        settings["output"] = Path(data["output"])
    if "seed" in data:
        if isinstance(data["seed"], bool) or not isinstance(data["seed"], int):
            raise MixError(f"{path}: seed must be an integer")
        settings["seed"] = data["seed"]
    if "max_repeats" in data:
        settings["max_repeats"] = _number(data["max_repeats"], f"{path}: max_repeats")
    if "source" in data:
        if not isinstance(data["source"], list):
            raise MixError(f"{path}: sources are [[source]] tables")
        settings["sources"] = [_source_table(t, f"{path}: source[{i}]") for i, t in enumerate(data["source"])]
    return settings


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge mix",
        description="Write one token pool drawn from several token-shard folders in the shares of their weights "
        "(or check one with --verify).",
    )
    parser.add_argument(
        "config",
        nargs="?",
        type=Path,
        metavar="CONFIG.toml",
        help="TOML file with tokens, output, ... and [[source]] tables",
    )
    parser.add_argument(
        "--source", action="append", metavar="NAME=FOLDER:WEIGHT", help="a source folder and its weight (repeat)"
    )
    parser.add_argument("--tokens", metavar="N", help="pool size in tokens: 5000000, 5_000_000, 5M, 2.5B")
    parser.add_argument("--output", type=Path, metavar="DIR", help="folder for the pool")
    parser.add_argument("--seed", type=int, metavar="S", help="seed of the document orders (default 0)")
    parser.add_argument(
        "--max-repeats", type=float, metavar="R", help="most passes over any source, >= 1 (default 1: no repeats)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the pool in a non-empty output folder")
    parser.add_argument("--verify", type=Path, metavar="DIR", help="recount a pool and check it against its manifest")
    return parser


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The mix settings: the TOML file's, then the flags given beside it."""
    settings: dict[str, Any] = {"seed": 0, "max_repeats": 1.0}
    if args.config is not None:
        settings.update(read_config(args.config))
    if args.source:
        if "sources" in settings:
            raise MixError(f"{args.config} has [[source]] tables: give the sources there or with --source, not both")
        settings["sources"] = [parse_source(s) for s in args.source]
    if args.tokens is not None:
        settings["tokens"] = parse_token_count(args.tokens)
    for key in ("output", "seed", "max_repeats"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    for key, flag in (("sources", "--source"), ("tokens", "--tokens"), ("output", "--output")):
        if key not in settings:
            raise MixError(f"{flag} is required (or give it in a TOML file: lmforge mix CONFIG.toml)")
    return settings


def source_table(title: str, manifest: MixManifest, tokens: Sequence[int], documents: Sequence[int]) -> Table:
    """Per source of `manifest`: the given tokens and documents, share of the pool, target share, and passes over
    the source (tokens / the source's tokens when the pool was written)."""
    table = Table(title=escape(title), title_justify="left")  # paths may hold [brackets], which rich reads as markup
    table.add_column("source")
    for column in ("tokens", "share", "target share", "documents", "repeats"):
        table.add_column(column, justify="right")
    total = max(sum(tokens), 1)
    for source, count, docs in zip(manifest.sources, tokens, documents, strict=True):
        passes = count / max(int(source.fingerprint.get("tokens", 0)), 1)
        table.add_row(
            source.name,
            f"{count:,}",
            f"{count / total:.2%}",
            f"{source.target_share:.2%}",
            f"{docs:,}",
            f"{passes:.3f}",
        )
    return table


def _verify(folder: Path) -> int:
    try:
        check = verify_mix(folder)
    except (MixError, ShardError, OSError) as e:
        return fail("mix", str(e))
    for line in check.warnings:
        print(f"warning: {line}", file=sys.stderr)
    m = check.manifest
    title = f"{folder}: {m.tokens:,} tokens in {m.documents:,} documents, consistent with its manifest"
    Console().print(source_table(title, m, check.tokens, check.documents), highlight=False)
    return 0


def main(argv: list[str]) -> int:
    """Run `lmforge mix` with the arguments after `mix`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.verify is not None:
        others = ("config", "source", "tokens", "output", "seed", "max_repeats")
        given = [a for a in others if getattr(args, a) is not None]
        if given or args.overwrite:
            return fail("mix", "--verify DIR takes no other arguments")
        return _verify(args.verify)
    try:
        settings = _settings(args)
        manifest = mix_sources(
            settings["sources"],
            settings["tokens"],
            settings["output"],
            seed=settings["seed"],
            max_repeats=settings["max_repeats"],
            overwrite=args.overwrite,
            command=["lmforge", "mix", *argv],
        )
    except (MixError, ShardError, OSError) as e:  # OSError: an output folder that cannot be written, a full disk
        return fail("mix", str(e))
    title = (
        f"{settings['output']}: {manifest.tokens:,} tokens ({manifest.tokens_requested:,} asked) in "
        f"{manifest.documents:,} documents, seed {manifest.seed}"
    )
    written = manifest.sources
    table = source_table(title, manifest, [s.tokens for s in written], [s.documents for s in written])
    Console().print(table, highlight=False)
    return 0
