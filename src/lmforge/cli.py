"""The `lmforge` command line: a table from command name to the module under `lmforge.commands` that runs it.

`lmforge train @ a.toml --data.seq-len 2048`, `sft @ a.toml` (the same trainer), `python -m lmforge train ...` and
`torchrun ... -m lmforge train ...` all come through `main`. A command module is imported only when it runs, so
`lmforge --help` and the light commands do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys

from lmforge.commands.errors import BAD_INPUT, fail

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "run the training loop (pretraining or SFT); `lmforge train --help` lists every config field"),
    "plan": ("plan", "will a config fit in GPU memory, and how fast will it go, on N GPUs (lmforge plan --help)"),
    "slurm": ("slurm", "submit the training as a Slurm job on one or many nodes (lmforge slurm --help)"),
    "tokenizer": ("tokenizer", "tokenizer tools: `lmforge tokenizer train` trains a byte-level BPE on local text"),
    "tokenize": ("tokenize", "turn local text into datatrove token shards"),
    "mix": ("mix", "write one token pool from several shard folders in weighted shares (lmforge mix --help)"),
    "export": ("export", "write a run's checkpoint as a plain Hugging Face model folder"),
    "sample": ("sample", "generate text from a model folder, run directory or checkpoint"),
    "plot": ("plot", "overlay metric curves of runs in an image (lmforge plot RUN_DIR ... -o curves.png)"),
    "report": ("report", "write a self-contained HTML report of a run"),
    "replay": ("replay", "list the documents a step trained on, or check its logged batch hash (lmforge replay -h)"),
    "demo": ("demo", "pretrain a small Llama on Shakespeare, prepared locally"),
    "chat-set": ("chat_set", "write a small chat SFT set (train/val JSONL) made from Shakespeare's plays"),
    "eval": ("eval", "score a run's snapshots on its [val] sets beside the training (lmforge eval RUN_DIR)"),
    "val-sets": ("val_sets", "convert lm-evaluation-harness-style JSONL into ctxcont / pairs eval set files"),
}
"""Command name -> (module under `lmforge.commands`, one-line summary for `lmforge --help`)."""


def usage() -> str:
    """The top-level help: every command with its summary."""
    lines = ["usage: lmforge COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command named by the first argument; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else BAD_INPUT
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        return fail(name, f"unknown command; the commands are {', '.join(COMMANDS)} (lmforge --help)")
    module = importlib.import_module(f"lmforge.commands.{COMMANDS[name][0]}")
    return int(module.main(rest))


def sft_main() -> int:
    """Entry point of the `sft` console script: the same trainer as `lmforge train`."""
    return main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    # `python -m lmforge.cli ...` must run the command too, not import the module and exit 0.
    sys.exit(main())
