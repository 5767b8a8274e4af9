"""A small chat SFT set made offline from the demo's Shakespeare scenes (`lmforge chat-set`).

Each example is a JSON line `{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}` built from the spoken
lines of one scene (stage directions and empty lines are skipped) for one of three tasks:

- `continue`: a line of a speech -> the next line of the same speech;
- `play`: 2-4 consecutive lines of a speech -> the play's title;
- `speaker`: 2-4 consecutive lines of a speech and the play's title -> the speaker's name (upper case).

Some examples open with a system turn, and some go on for a second exchange about the same passage (the line after
that, who speaks it, or the speaker's next line), so multi-turn data is exercised. Whole scenes go to `val.jsonl`
by the same draw as the demo's holdout (`lmforge tokenize --holdout F --seed S` over `corpus/scenes.jsonl`): with
the defaults (seed 0, fraction 0.05) the val scenes are the scenes the demo's pretraining held out, so val lines
were seen neither in pretraining nor in fine-tuning. All sampling uses `random.Random(seed)`, so the same seed
gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.prep.shakespeare import Scene, shakespeare_scenes
from lmforge.prep.tokenize import in_holdout

SYSTEM_PROMPT = "You are a helpful assistant who knows Shakespeare's plays."
TASKS = ("continue", "play", "speaker")
TASK_WEIGHTS = (0.4, 0.3, 0.3)
"""Share of each task (in `TASKS` order) among the examples of a split."""
SYSTEM_SHARE = 0.25
"""Chance that an example opens with the system turn."""
TWO_TURN_SHARE = 0.1
"""Chance that an example goes on for a second exchange, when its passage allows one."""
DEFAULT_TRAIN_EXAMPLES = 20_000
MIN_CONTINUE_WORDS = 3
"""Both lines of a `continue` example have at least this many words: wrapped prose leaves fragments such as
'thus strong,' that no one could continue or guess."""
MAX_DRAWS_PER_EXAMPLE = 20
"""Duplicates are redrawn; a split whose scenes cannot give enough distinct examples stops after this many draws
per wanted example and comes out smaller."""

# Words that may stay lower case in a speaker's name ('FIRST CITIZEN of CALAIS', 'DUKE OF VENICE & Senator').
_NAME_PARTICLES = frozenset({"of", "and", "the", "de", "du", "le", "la", "&", "in", "to", "a"})
_BRACKETED = re.compile(r"\[[^\[\]]*\]")
_MARKDOWN_ESCAPE = re.compile(r"\\([-\\`*_{}()#+.!'\"])")


class ChatSetError(ValueError):
    """A chat set that cannot be written: an option out of range, an output path that is not a folder, no plays
    installed, or scenes that give no training example."""


@dataclass(frozen=True)
class Speech:
    """One speech of a scene: the speaker and the spoken lines, stage directions removed."""

    speaker: str
    """The speaker's name, normalized (`normalize_speaker`)."""
    lines: tuple[str, ...]
    """The spoken lines, in order, none empty."""


@dataclass(frozen=True)
class ChatSet:
    """The examples of both splits and where they came from."""

    train: list[dict[str, Any]]
    """Rows of train.jsonl: {"id", "messages"}."""
    val: list[dict[str, Any]]
    """Rows of val.jsonl, from scenes that train never quotes."""
    train_scenes: int
    """Scenes on the train side of the split."""
    val_scenes: int
    """Scenes on the val side of the split."""


def normalize_speaker(name: str) -> str:
    """A speaker's name as an answer: colons dropped, spaces collapsed, upper case ('First Lord' -> 'FIRST LORD')."""
    return " ".join(name.replace(":", " ").split()).upper()


def _speaker_of(line: str) -> str | None:
    """The speaker named by a `NAME:` line, or None for a spoken line that merely ends with a colon."""
    if not line.endswith(":"):
        return None
    name = line.replace(":", " ").strip()
    words = name.split()
    # Verse lines that end with ':' after a stage direction look the same; they carry punctuation or lower-case
    # words, which names of several words do not (checked against the bold names of the source Markdown).
    if not words or re.search(r"[,;!?\[\]]", name) or re.match(r"(?i)(act|scene)\b", name):
        return None
    if not words[0][0].isupper() or len(words) > 8:
        return None
    if len(words) > 2 and not all(w in _NAME_PARTICLES or not w[0].isalpha() or w[0].isupper() for w in words):
        return None
    return normalize_speaker(name)


def spoken_line(line: str) -> str | None:
    """A line of text with stage directions and Markdown escapes removed; None when nothing spoken is left.

    A line whose brackets do not pair up is dropped whole: it comes from a stage direction that swallowed speech.
    """
    previous = None
    while previous != line:
        previous, line = line, _BRACKETED.sub(" ", line)
    if "[" in line or "]" in line:
        return None
    line = " ".join(_MARKDOWN_ESCAPE.sub(r"\1", line).split())
    if not line or "_" in line or "*" in line:
        return None
    return line


def scene_speeches(scene: Scene) -> list[Speech]:
    """The speeches of a scene, in order; text before the first speaker and speeches with no spoken line are left
    out.

    A speaker line is `NAME:` alone after an empty line (or at the top); a speech runs to the next speaker line, across
    any stage directions in between.
    """
    speeches: list[Speech] = []
    speaker: str | None = None
    lines: list[str] = []
    previous_empty = True
    # The first line is the scene's heading, not speech.
    for raw in scene.text.split("\n")[1:]:
        raw = raw.strip()
        name = _speaker_of(raw) if previous_empty else None
        previous_empty = not raw
        if name is not None:
            if speaker is not None and lines:
                speeches.append(Speech(speaker, tuple(lines)))
            speaker, lines = name, []
        elif speaker is not None and (line := spoken_line(raw)) is not None:
            lines.append(line)
    if speaker is not None and lines:
        speeches.append(Speech(speaker, tuple(lines)))
    return speeches


def scene_doc_id(index: int) -> str:
    """The document id that `lmforge tokenize` gives scene `index` of the demo's `corpus/scenes.jsonl`.

    The holdout draw hashes this id; using the same one here puts the same scenes in val as in the demo's heldout.
    """
    return f"scenes.jsonl:{index + 1}"


def split_scenes(scenes: Sequence[Scene], seed: int, val_fraction: float) -> tuple[list[Scene], list[Scene]]:
    """(train, val) scenes, each scene wholly on one side, drawn from (seed, position in `scenes`).

    Positions are those of `shakespeare_scenes()` order for real data, which the demo's corpus file keeps.
    """
    train: list[Scene] = []
    val: list[Scene] = []
    for i, scene in enumerate(scenes):
        (val if in_holdout(scene_doc_id(i), seed, val_fraction) else train).append(scene)
    return train, val


def play_answer(play: str) -> str:
    """The answer to 'which play': the title as a sentence."""
    return play if play.endswith((".", "!", "?")) else f"{play}."


@dataclass(frozen=True)
class _Passage:
    play: str
    speech: Speech
    start: int


def _continue_pool(scenes: Sequence[Scene], speeches: Sequence[list[Speech]]) -> list[_Passage]:
    pool = []
    for scene, scene_speech in zip(scenes, speeches, strict=True):
        for speech in scene_speech:
            for i in range(len(speech.lines) - 1):
                if min(len(speech.lines[i].split()), len(speech.lines[i + 1].split())) >= MIN_CONTINUE_WORDS:
                    pool.append(_Passage(scene.play, speech, i))
    return pool


def _passage_pool(scenes: Sequence[Scene], speeches: Sequence[list[Speech]]) -> list[_Passage]:
    # Every start that leaves room for two lines; long speeches offer more starts, so each line weighs the same.
    return [
        _Passage(scene.play, speech, i)
        for scene, scene_speech in zip(scenes, speeches, strict=True)
        for speech in scene_speech
        for i in range(len(speech.lines) - 1)
    ]


def _turns(task: str, passage: _Passage, rng: random.Random) -> list[tuple[str, str]]:
    """(user, assistant) exchanges for one example: one, or two when the draw asks for it and the passage allows."""
    lines, start = passage.speech.lines, passage.start
    two_turn = rng.random() < TWO_TURN_SHARE
    if task == "continue":
        turns = [(f"Continue this line from Shakespeare:\n{lines[start]}", lines[start + 1])]
        if two_turn and start + 2 < len(lines):
            turns.append(("And the line after that?", lines[start + 2]))
        return turns
    end = min(len(lines), start + rng.randint(2, 4))
    text = "\n".join(lines[start:end])
    if task == "play":
        turns = [(f"Which play is this passage from?\n{text}", play_answer(passage.play))]
        if two_turn:
            turns.append(("Who speaks these lines?", passage.speech.speaker))
        return turns
    turns = [(f"Who speaks these lines in {passage.play}?\n{text}", passage.speech.speaker)]
    if two_turn and end < len(lines):
        turns.append(("What is their next line?", lines[end]))
    return turns


def _task_quota(count: int) -> list[str]:
    """`count` task names in `TASK_WEIGHTS` proportions (largest remainders get the rounding)."""
    exact = [count * w / sum(TASK_WEIGHTS) for w in TASK_WEIGHTS]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(TASKS)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    return [task for task, n in zip(TASKS, counts, strict=True) for _ in range(n)]


def build_examples(scenes: Sequence[Scene], count: int, rng: random.Random, split: str) -> list[dict[str, Any]]:
    """Up to `count` distinct examples from `scenes`, tasks in `TASK_WEIGHTS` proportions, in shuffled order.

    Fewer come back when the scenes cannot give enough distinct ones (a task with no usable passage gives none).
    Ids are `<split>-<n>-<task>`, with `+2` on the task of a two-exchange example.
    """
    speeches = [scene_speeches(scene) for scene in scenes]
    pools = {"continue": _continue_pool(scenes, speeches)}
    pools["play"] = pools["speaker"] = _passage_pool(scenes, speeches)
    tasks = _task_quota(count)
    rng.shuffle(tasks)
    seen: set[tuple[str, ...]] = set()
    examples: list[dict[str, Any]] = []
    draws = 0
    for task in tasks:
        pool = pools[task]
        while pool and draws < MAX_DRAWS_PER_EXAMPLE * count:
            draws += 1
            turns = _turns(task, rng.choice(pool), rng)
            key = (task, *turns[0])
            if key in seen:
                continue
            seen.add(key)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < SYSTEM_SHARE else []
            for user, assistant in turns:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            name = task if len(turns) == 1 else f"{task}+2"
            examples.append({"id": f"{split}-{len(examples):05d}-{name}", "messages": messages})
            break
    return examples


def _spoken_line_count(scenes: Sequence[Scene]) -> int:
    return sum(len(speech.lines) for scene in scenes for speech in scene_speeches(scene))


def make_chat_set(
    scenes: Sequence[Scene], seed: int = 0, val_fraction: float = 0.05, train_examples: int = DEFAULT_TRAIN_EXAMPLES
) -> ChatSet:
    """Split `scenes` by scene and build `train_examples` train examples (fewer if the scenes run out) and a val
    set sized by the val scenes' share of spoken lines.

    `scenes` should be in `shakespeare_scenes()` order for the split to match the demo's pretraining holdout.
    """
    train_scenes, val_scenes = split_scenes(scenes, seed, val_fraction)
    train_lines = _spoken_line_count(train_scenes)
    val_count = round(train_examples * _spoken_line_count(val_scenes) / train_lines) if train_lines else 0
    rng = random.Random(seed)
    train = build_examples(train_scenes, train_examples, rng, "train")
    val = build_examples(val_scenes, val_count, rng, "val")
    return ChatSet(train, val, len(train_scenes), len(val_scenes))


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write `rows` as JSON lines to a temporary file next to `path`, then move it into place.

    A reader never sees a half-written file, and an interrupted run leaves the previous file as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def summary(chat_set: ChatSet, seconds: float) -> str:
    """One line: examples per split, per task, how many are multi-turn or carry a system turn."""
    rows = chat_set.train + chat_set.val
    tasks = Counter(row["id"].split("-", 2)[2].removesuffix("+2") for row in rows)
    per_task = ", ".join(f"{task} {tasks[task]}" for task in TASKS)
    two_turn = sum(row["id"].endswith("+2") for row in rows)
    system = sum(row["messages"][0]["role"] == "system" for row in rows)
    return (
        f"chat-set: train {len(chat_set.train)} examples ({chat_set.train_scenes} scenes), val {len(chat_set.val)} "
        f"({chat_set.val_scenes} scenes); {per_task}; two-turn {two_turn}, with system turn {system}; {seconds:.1f}s"
    )


def write_chat_set(
    output: Path, seed: int = 0, val_fraction: float = 0.05, train_examples: int = DEFAULT_TRAIN_EXAMPLES
) -> ChatSet:
    """Build the chat set from the installed plays (`shakespeare_scenes`, `make_chat_set`) and write
    `output/train.jsonl` and `output/val.jsonl` (`write_jsonl`); returns what was written.

    Raises `ChatSetError` for an option out of range, an `output` that is not a folder, missing plays or a train
    split with no example; nothing is written then.
    """
    # Messages name the command-line option of each value: `lmforge chat-set` passes them through as they are.
    if not 0.0 <= val_fraction < 1.0:
        raise ChatSetError(f"--val-fraction {val_fraction}: must be at least 0 and below 1")
    if train_examples < 1:
        raise ChatSetError(f"--max-examples {train_examples}: must be at least 1")
    if output.exists() and not output.is_dir():
        raise ChatSetError(f"--output {output}: exists and is not a folder")
    try:
        scenes = shakespeare_scenes()
    except FileNotFoundError as e:
        raise ChatSetError(str(e)) from e
    chat_set = make_chat_set(scenes, seed, val_fraction, train_examples)
    if not chat_set.train:
        raise ChatSetError("the scenes gave no training examples")
    output.mkdir(parents=True, exist_ok=True)
    write_jsonl(output / "train.jsonl", chat_set.train)
    write_jsonl(output / "val.jsonl", chat_set.val)
    return chat_set
