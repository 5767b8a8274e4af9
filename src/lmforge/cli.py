"""`lmforge` command line: `lmforge train @ a.toml @ b.toml --data.seq-len 2048 ...` (`sft` is the same)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

USAGE_TRAIN = """usage: lmforge train [@ FILE.toml ...] [--section.field VALUE ...] [--no-section.flag]
                     [--overwrite] [--dry-run]

Config files are deep-merged left to right, then the flags apply (later wins). Run under torchrun for several
processes: torchrun --nproc-per-node 8 -m lmforge train @ run.toml"""


def _err(message: str) -> None:
    # Under torchrun every rank sees the same config error; one copy is enough.
    if os.environ.get("RANK", "0") == "0":
        # Messages name TOML sections such as [model.arch]: escape them so rich does not read them as markup.
        Console(stderr=True).print(f"[bold red]lmforge:[/] {escape(message)}", highlight=False, soft_wrap=True)


def train_command(argv: list[str]) -> int:
    """Validate the config, then train on this process's rank; returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE_TRAIN)
        return 0
    from lmforge.config import ConfigError, dump_toml, load_train_config
    from lmforge.train.parallel import env_world_size

    overwrite = "--overwrite" in argv
    argv = [a for a in argv if a != "--overwrite"]
    try:
        config, raw = load_train_config(argv, env_world_size())
    except ConfigError as e:
        _err(str(e))
        return 2
    if raw.dry_run:
        print(dump_toml(config), end="")
        return 0

    import torch.distributed as dist

    from lmforge.data import DataError
    from lmforge.eval.sets import EvalSetError
    from lmforge.model.hf_config import HFModelError
    from lmforge.train.checkpoint import CheckpointError
    from lmforge.train.parallel import init_distributed, shutdown_distributed
    from lmforge.train.setup import prepare_output_dir
    from lmforge.train.trainer import Trainer

    ctx = init_distributed()
    try:
        # Rank 0 owns the run directory; every rank learns whether it could be prepared (and which checkpoint
        # the run resumes from), so none waits alone.
        shared: list[object] = [None, None]
        if ctx.is_main:
            try:
                ckpt = prepare_output_dir(config, overwrite)
                shared[1] = None if ckpt is None else str(ckpt)
            except (ConfigError, CheckpointError) as e:
                shared[0] = str(e)
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None:
            _err(str(shared[0]))
            return 2
        resume_from = None if shared[1] is None else Path(str(shared[1]))
        try:
            trainer = Trainer(config, ctx, resume_from=resume_from)
        except (ConfigError, CheckpointError, HFModelError, EvalSetError, *DataError) as e:
            _err(str(e))
            return 2
        trainer.train()
    finally:
        shutdown_distributed()
    return 0


def export_command(argv: list[str]) -> int:
    """`lmforge export RUN_DIR|CHECKPOINT --output DIR [--dtype bfloat16|float32] [--max-shard-size GB]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lmforge export",
        description="Write a run's latest checkpoint (or the checkpoint folder given) as a plain Hugging Face model "
        "folder: config.json, generation_config.json, tokenizer files and safetensors weights.",
    )
    parser.add_argument("source", type=Path, help="a run directory or one of its checkpoints/step_N folders")
    parser.add_argument("--output", "-o", type=Path, required=True, help="the folder to create")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the weights")
    parser.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors file (default 5)")
    args = parser.parse_args(argv)
    from lmforge.hf_folder import export_model
    from lmforge.model.hf_config import HFModelError
    from lmforge.train.checkpoint import CheckpointError

    try:
        ckpt = export_model(args.source, args.output, args.dtype, int(args.max_shard_size * 1e9))
    except (CheckpointError, HFModelError, FileExistsError) as e:
        _err(str(e))
        return 2
    Console().print(f"exported {ckpt} -> {args.output} ({args.dtype})", highlight=False)
    return 0


COMMANDS = {
    "train": "run the training loop (pretraining or SFT)",
    "tokenizer": "tokenizer tools: `lmforge tokenizer train` trains a byte-level BPE on local text",
    "tokenize": "turn local text into datatrove token shards",
    "export": "write a run's checkpoint as a plain Hugging Face model folder",
    "sample": "generate text from a model folder, run directory or checkpoint",
    "plot": "overlay metric curves of runs in an image (lmforge plot RUN_DIR ... -o curves.png)",
    "report": "write a self-contained HTML report of a run",
    "demo": "pretrain a small Llama on Shakespeare, prepared locally",
    "chat-set": "write a small chat SFT set (train/val JSONL) made from Shakespeare's plays",
    "eval": "score a run's snapshots on its [val] sets beside the training (lmforge eval RUN_DIR)",
    "val-sets": "convert lm-evaluation-harness-style JSONL into ctxcont / pairs eval set files",
}


def _usage() -> str:
    lines = ["usage: lmforge COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lmforge` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train_command(rest)
    if command == "tokenize":
        from lmforge.prep.tokenize import tokenize_main

        return tokenize_main(rest)
    if command == "tokenizer" and rest[:1] == ["train"]:
        from lmforge.prep.tokenizer_train import tokenizer_main

        return tokenizer_main(rest[1:])
    if command == "export":
        return export_command(rest)
    if command == "sample":
        from lmforge.sample import sample_main

        return sample_main(rest)
    if command == "plot":
        from lmforge.viz.plot import plot_main

        return plot_main(rest)
    if command == "report":
        from lmforge.viz.report import report_main

        return report_main(rest)
    if command == "demo":
        from lmforge.demo import demo_main

        return demo_main(rest)
    if command == "eval":
        from lmforge.eval.worker import eval_main

        return eval_main(rest)
    if command == "val-sets":
        from lmforge.prep.val_sets import val_sets_main

        return val_sets_main(rest)
    if command == "chat-set":
        from lmforge.prep.chat_set import chat_set_main

        return chat_set_main(rest)
    _err(f"unknown command {' '.join(argv[:2])!r}\n{_usage()}")
    return 2


def sft_main() -> int:
    """Entry point of the `sft` console script: the same trainer as `lmforge train`."""
    return main(["train", *sys.argv[1:]])
