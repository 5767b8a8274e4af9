"""`lmforge sample MODEL_DIR|RUN_DIR|CHECKPOINT --prompt "..."`: stream text from a trained model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmforge.commands.errors import CommandParser, fail, parse_args


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

    from lmforge.data.tokenizer import TokenizerError
    from lmforge.model.generate import TextStream, generate
    from lmforge.model.hf_config import HFModelError
    from lmforge.runtime.checkpoint import CheckpointError
    from lmforge.runtime.hf_folder import load_pretrained

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
        sys.stdout.write(args.prompt)
    stream = TextStream(tokenizer.tokenizer)
    tokens = generate(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=stop,
    )
    for token in tokens:
        if token in stop:
            break
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    return 0
