"""`lmforge export RUN_DIR|CHECKPOINT --output DIR [--dtype bfloat16|float32] [--max-shard-size GB]`."""

from __future__ import annotations

import math
from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge export",
        description="Write a run's latest checkpoint (or the checkpoint folder given) as a plain Hugging Face model "
        "folder: config.json, generation_config.json, tokenizer files and safetensors weights.",
    )
    parser.add_argument("source", type=Path, help="a run directory or one of its checkpoints/step_N folders")
    parser.add_argument("--output", "-o", type=Path, required=True, help="the folder to create")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the weights")
    parser.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors file (default 5)")
    return parser


def main(argv: list[str]) -> int:
    """Export the checkpoint; returns the exit code (2 for a missing or unusable checkpoint)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    # Checked before the checkpoint is read: int() of a NaN or infinite size raises, and a size under one byte or a
    # file in the way of --output would fail only once the weights are loaded, with a traceback.
    shard_bytes = args.max_shard_size * 1e9
    if not math.isfinite(shard_bytes) or shard_bytes < 1:
        return fail("export", f"--max-shard-size {args.max_shard_size}: must be a finite number of GB, at least 1e-9")
    if args.output.exists() and not args.output.is_dir():
        return fail("export", f"--output {args.output}: exists and is not a folder")
    from rich.console import Console

    from lmforge.checkpoint.layout import CheckpointError
    from lmforge.config.hf_config import HFModelError
    from lmforge.hf.folder import export_model

    try:
        ckpt = export_model(args.source, args.output, args.dtype, int(shard_bytes))
    except (CheckpointError, HFModelError, FileExistsError) as e:
        return fail("export", str(e))
    Console().print(f"exported {ckpt} -> {args.output} ({args.dtype})", highlight=False)
    return 0
