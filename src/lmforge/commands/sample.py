"""`lmforge sample MODEL_DIR|RUN_DIR|CHECKPOINT --prompt "..."`: stream text from a trained model."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from lmforge.commands.errors import CommandParser, fail, parse_args

MIN_TEMPERATURE = 1e-6
"""The smallest positive --temperature: below it, logits / temperature can overflow to inf in float32, and the
softmax of inf is NaN; such a temperature is greedy in all but name, and 0 says so."""


def _device_problem(name: str) -> str | None:
    """Why `--device name` cannot run the model, or None when it can."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        return f"--device {name!r}: {e}"
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return f"--device {name}: no such CUDA device ({count} visible)"
        return None
    if device.type == "mps" and torch.backends.mps.is_available():
        return None
    return f"--device {name}: not available here; use cpu, cuda or cuda:N"


def _flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sampling flags, or None. Checked before the model loads, so that a bad flag is
    reported at once rather than as a traceback from generation."""
    if args.max_new_tokens < 0:
        return f"--max-new-tokens {args.max_new_tokens}: must be 0 or more"
    if not 0.0 < args.top_p <= 1.0:
        return f"--top-p {args.top_p}: must be in (0, 1]"
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        return f"--temperature {args.temperature}: must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}"
    if not -(2**63) <= args.seed < 2**64:
        return f"--seed {args.seed}: must fit in 64 bits"
    return None if args.device == "auto" else _device_problem(args.device)


def main(argv: list[str]) -> int:
    """Load a model (HF folder, run directory or checkpoint), then print the prompt and its continuation."""
    parser = CommandParser(
        prog="lmforge sample",
        description="Generate text with a KV cache from an HF model folder, a run directory (its latest "
        "checkpoint) or a checkpoints/step_N folder, on the CPU or a GPU.",
    )
    parser.add_argument("model", type=Path, help="HF model folder, run directory or checkpoint folder")
    parser.add_argument("--prompt", required=True, help="text to continue (with --chat: the user's message)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="render the prompt as a user turn with the tokenizer's chat template and print the assistant's reply, "
        "which ends at EOS or any other special token",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same text")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    problem = _flag_problem(args)
    if problem is not None:
        return fail("sample", problem)

    from lmforge.checkpoint.layout import CheckpointError
    from lmforge.config.hf_config import HFModelError
    from lmforge.data.tokenizer import TokenizerError
    from lmforge.hf.folder import load_pretrained
    from lmforge.model.generate import TextStream, generate

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer = load_pretrained(args.model, device)
    except (CheckpointError, HFModelError, TokenizerError) as e:
        return fail("sample", str(e))
    if tokenizer is None:
        return fail("sample", f"{args.model} has no tokenizer files: cannot turn the prompt into tokens")
    if not args.prompt:
        return fail("sample", "--prompt is empty: give the text to continue")
    stop = {tokenizer.eos_id}
    if args.chat:
        from lmforge.data.chat import ChatError, ChatTemplate

        try:
            text = ChatTemplate.of(tokenizer).render([{"role": "user", "content": args.prompt}], True)
        except ChatError as e:
            return fail("sample", str(e))
        # The template writes its own special tokens; a reply ends at the first special token it generates.
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        stop |= {int(i) for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}
    else:
        # Encoded as the training data was: the tokenizer's own post-processor decides whether a BOS comes first.
        ids = tokenizer.tokenizer.encode(args.prompt).ids
    stream = TextStream(tokenizer.tokenizer)
    try:
        tokens = generate(
            model,
            ids,
            args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            eos_id=stop,
        )
    except ValueError as e:  # checked before the first token: a prompt longer than the model's context, say
        return fail("sample", str(e))
    if not args.chat:
        sys.stdout.write(args.prompt)
    for token in tokens:
        if token in stop:
            break
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    return 0
