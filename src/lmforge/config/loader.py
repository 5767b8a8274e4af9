"""Compose a config from TOML files and command-line flags, and report errors by file and dotted field.

Sources, later wins: the defaults of the config classes, `@ a.toml @ b.toml` (deep-merged left to right),
then flags such as `--data.seq-len 2048`, `--model.compile` (true) or `--no-model.compile` (false).
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import tomli_w
from pydantic import BaseModel, ValidationError

CLI_SOURCE = "the command line"


class ConfigError(Exception):
    """A config that cannot be used; the message names the source file, the dotted field and the problem."""


@dataclass
class RawConfig:
    """A merged, not yet validated config and where each of its values came from."""

    values: dict[str, Any] = field(default_factory=dict)
    """The merged TOML tree."""
    sources: dict[str, str] = field(default_factory=dict)
    """Dotted path -> the file (or the command line) that set it last."""
    dry_run: bool = False
    """`--dry-run` was given."""

    def source_of(self, dotted: str) -> str | None:
        """Where the value of `dotted` came from: the source that set it or its closest parent, and every other
        source that set a field inside it (a table from a file with one of its fields from a flag names both),
        joined with "and", the command line last."""
        parts = dotted.split(".")
        found = []
        for n in range(len(parts), 0, -1):
            src = self.sources.get(".".join(parts[:n]))
            if src is not None:
                found.append(src)
                break
        found += [src for key, src in self.sources.items() if key.startswith(dotted + ".")]
        unique = sorted(dict.fromkeys(found), key=lambda src: src == CLI_SOURCE)
        return " and ".join(unique) if unique else None


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, Mapping):
            yield from _flatten(value, path + ".")


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `update` into `base` in place: tables merge key by key, every other value replaces."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
    return base


def parse_value(raw: str) -> Any:
    """A flag value as TOML (`2048`, `3e-4`, `true`, `["a", "b"]`), else the plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except ValueError:  # TOMLDecodeError, or an integer beyond Python's 4300-digit conversion limit
        return raw


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def _flag_key(flag: str) -> str:
    return ".".join(part.replace("-", "_") for part in flag.split("."))


def read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file, with errors that name it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a TOML file") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ConfigError(f"config file {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text (byte {e.start})") from None
    except ValueError as e:
        # Besides TOMLDecodeError, tomllib lets through int()'s limit of 4300 digits, whose advice to call
        # sys.set_int_max_str_digits (after the ';') is meant for programmers, not for the author of the file.
        raise ConfigError(f"{path}: not valid TOML: {str(e).split(';')[0]}") from None


def compose(argv: list[str]) -> RawConfig:
    """Merge `@ file` arguments and `--dotted.field value` flags, in the order given."""
    raw = RawConfig()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or (arg.startswith("@") and len(arg) > 1):
            if arg == "@":
                if i + 1 >= len(argv):
                    raise ConfigError("'@' must be followed by a TOML file")
                i += 1
                name = argv[i]
            else:
                name = arg[1:]
            tree = read_toml(Path(name))
            deep_merge(raw.values, tree)
            for dotted in _flatten(tree):
                raw.sources[dotted] = name
        elif arg == "--dry-run":
            raw.dry_run = True
        elif arg.startswith("--"):
            body = arg[2:]
            if "=" in body:
                flag, text = body.split("=", 1)
                value = parse_value(text)
            elif body.startswith("no-") and (i + 1 >= len(argv) or argv[i + 1].startswith(("--", "@"))):
                flag, value = body[3:], False
            elif i + 1 >= len(argv) or argv[i + 1].startswith("--") or argv[i + 1].startswith("@"):
                flag, value = body, True
            else:
                flag, value = body, parse_value(argv[i + 1])
                i += 1
            if not flag:
                raise ConfigError(f"malformed flag {arg!r}")
            dotted = _flag_key(flag)
            _set_dotted(raw.values, dotted, value)
            raw.sources[dotted] = CLI_SOURCE
        else:
            raise ConfigError(
                f"unexpected argument {arg!r}: use '@ FILE.toml' for config files "
                "and '--section.field VALUE' for fields"
            )
        i += 1
    return raw


@functools.cache
def _field_index(
    model: type[BaseModel],
) -> tuple[dict[str, list[str]], frozenset[str], dict[tuple[str, str], list[str]]]:
    """Each section's field names by dotted path, the union tags pydantic inserts into error locations, and the
    field names of each union member by (dotted path, tag): a union section's own entry lists its last member's."""
    known: dict[str, list[str]] = {}
    tags: set[str] = set()
    members: dict[tuple[str, str], list[str]] = {}

    def walk(section: type[BaseModel], prefix: str) -> None:
        known[prefix] = [info.alias or name for name, info in section.model_fields.items()]
        for name, info in section.model_fields.items():
            stack = [info.annotation]
            while stack:
                ann = stack.pop()
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    key = info.alias or name
                    path = f"{prefix}.{key}" if prefix else key
                    walk(ann, path)
                    # a plain union (`str | ValSetConfig`) names its member in the error location
                    member_tags = {ann.__name__}
                    tag_field = ann.model_fields.get("type") or ann.model_fields.get("model_type")
                    if tag_field is not None:
                        member_tags.update(str(a) for a in get_args(tag_field.annotation))
                    tags.update(member_tags)
                    for tag in member_tags:
                        members[(path, tag)] = known[path]
                else:
                    stack.extend(get_args(ann))

    walk(model, "")
    return known, frozenset(tags), members


def _describe(err: Mapping[str, Any], raw: RawConfig, model: type[BaseModel]) -> str:
    known, tags, members = _field_index(model)
    dotted = ".".join(str(p) for p in err["loc"] if p not in tags) or "(root)"
    kind = err["type"]
    if kind == "missing":
        if dotted in known:
            return f"{dotted}: required section [{dotted}] is missing"
        return f"{dotted}: required field is missing (set it in a TOML file or with --{dotted.replace('_', '-')})"
    msg = err["msg"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        disc = str(err.get("ctx", {}).get("discriminator", "type")).strip("'")
        dotted += "." + (disc if disc.isidentifier() else "type")
        expected = err.get("ctx", {}).get("expected_tags", "")
        msg = f"expected one of {expected}" + (f", got {err['ctx']['tag']!r}" if "tag" in err.get("ctx", {}) else "")
    src = raw.source_of(dotted) or "the defaults"
    if kind == "extra_forbidden":
        parent = dotted.rsplit(".", 1)[0] if "." in dotted else ""
        msg = "unknown field"
        # Inside a union the location names the member the value was checked against: list that member's fields.
        tag = str(err["loc"][-2]) if len(err["loc"]) > 1 else ""
        fields = members.get((parent, tag)) or known.get(parent)
        if fields:
            msg += f" (known fields here: {', '.join(fields)})"
    elif "input" in err and not isinstance(err["input"], dict | list):
        msg += f", got {err['input']!r}"
    return f"{dotted} (from {src}): {msg}"


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool"})


def _one_union_member(errors: list[Any], tags: frozenset[str]) -> list[Any]:
    """Drop the errors of the union member the value was not meant for: a value of `str | Table` that is a table
    is reported against the table's fields only, anything else against the scalar only."""
    scalar_input: dict[tuple[Any, ...], Any] = {}
    for err in errors:
        loc = err["loc"]
        for i, part in enumerate(loc):
            if part in _SCALAR_TAGS and i == len(loc) - 1:
                scalar_input[tuple(loc[:i])] = err.get("input")
    kept = []
    for err in errors:
        loc = err["loc"]
        prefix = next((tuple(loc[:i]) for i, p in enumerate(loc) if p in tags or p in _SCALAR_TAGS), None)
        if prefix in scalar_input:
            table = isinstance(scalar_input[prefix], dict)
            if table == (loc[len(prefix)] in _SCALAR_TAGS):
                continue
        kept.append({**err, "loc": tuple(p for p in loc if p not in _SCALAR_TAGS)})
    return kept


def validate(model: type[BaseModel], raw: RawConfig) -> BaseModel:
    """Validate a merged config; every error becomes one line naming the source, field and expectation."""
    try:
        return model.model_validate(raw.values)
    except ValidationError as e:
        _, tags, _ = _field_index(model)
        lines = [_describe(err, raw, model) for err in _one_union_member(e.errors(), tags)]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def dump_toml(config: BaseModel) -> str:
    """The config as TOML that loads back to an equal config (unset optional fields are omitted)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True, by_alias=True))
