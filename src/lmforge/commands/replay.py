"""`lmforge replay RUN --step N [--micro-batch I] [--score [--checkpoint K] [--top T]] [--json FILE] [--chars C]` and
`lmforge replay RUN --verify` and `lmforge replay RUN --document FILE:INDEX`.

Replay rebuilds, in one process and from the run directory alone (its config.toml, the data and tokenizer it names,
and its checkpoints' data positions), the micro-batches a step trained on, and lists the documents in each
(`lmforge.data.replay`). `--score` adds each document's loss under a checkpoint's weights
(`lmforge.eval.document_loss`) and lists the documents with the highest summed loss. `--verify` recomputes the
`batch/hash` each logged step recorded (`log.batch_hashes`) and names the first step whose data differs.
`--document` lists every step that trained on one document.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.commands.errors import CommandParser, fail, parse_args

USAGE = (
    "lmforge replay RUN_DIR --step N [--micro-batch I] [--score [--checkpoint K] [--top T]] [--json FILE] [--chars C]"
    " | RUN_DIR --verify [--step N] | RUN_DIR --document [SOURCE:]FILE:INDEX"
)


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge replay",
        usage=USAGE,
        description="List the documents a training step trained on, rebuilt from the run directory in one process "
        "whatever the number of ranks that trained it; or check the steps' logged batch hashes against the data.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run's output_dir")
    parser.add_argument("--step", type=int, help="the optimizer step (1 is the first)")
    parser.add_argument("--micro-batch", type=int, help="only this micro-batch of the step (its global index)")
    parser.add_argument("--json", type=Path, help="also write the listing to this JSON file")
    parser.add_argument("--score", action="store_true", help="score every document with a checkpoint's weights")
    parser.add_argument("--checkpoint", type=int, help="the checkpoint step to score with (default: the newest one "
                        "at or before step N - 1)")  # fmt: skip
    parser.add_argument("--top", type=int, default=10, help="documents listed by summed loss with --score (default 10)")
    parser.add_argument("--chars", type=int, default=120, help="characters of text shown per document (0: all)")
    parser.add_argument("--document", help="[SOURCE:]FILE:INDEX (a token shard's INDEX-th document, as the listing "
                        "names it) or FILE:LINE (an SFT row): list every step that trained on it")  # fmt: skip
    parser.add_argument("--verify", action="store_true", help="recompute the logged batch/hash of every logged step "
                        "(or of --step) and compare")  # fmt: skip
    return parser


def main(argv: list[str]) -> int:
    """Run `lmforge replay`; returns the exit code (1 when --verify finds a step whose data differs, 2 for bad
    input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.step is not None and args.step < 1:
        return fail("replay", f"--step {args.step}: steps count from 1")
    if not args.verify and args.step is None and args.document is None:
        return fail("replay", "give --step N (the step to list), --verify or --document FILE:INDEX")
    if args.chars < 0:
        return fail("replay", f"--chars {args.chars}: must be 0 (all) or more")
    if args.top < 1:
        return fail("replay", f"--top {args.top}: must be at least 1")
    if args.checkpoint is not None and not args.score:
        return fail("replay", "--checkpoint chooses the weights of --score: give --score too")
    from lmforge.checkpoint.layout import CheckpointError
    from lmforge.config import ConfigError
    from lmforge.config.hf_config import HFModelError
    from lmforge.data.replay import ReplayError
    from lmforge.data.stream import DataError

    try:
        if args.verify:
            return _verify(args.run_dir, args.step)
        if args.document is not None:
            return _document(args.run_dir, args.document)
        return _list(args)
    except (ConfigError, CheckpointError, HFModelError, ReplayError, *DataError) as e:
        return fail("replay", str(e))
    except OSError as e:
        return fail("replay", f"{e.filename or args.run_dir}: {e.strerror or e}")


def _verify(run_dir: Path, only: int | None) -> int:
    from rich.console import Console

    from lmforge.data.batch_hash import micro_batch_hash, step_hash
    from lmforge.data.replay import ReplayError
    from lmforge.eval.step_documents import RunSteps
    from lmforge.monitor.jsonl import read_metrics

    metrics = run_dir / "metrics.jsonl"
    logged = {int(r["step"]): int(r["batch/hash"]) for r in read_metrics(metrics) if "batch/hash" in r}
    if only is not None:
        if only not in logged:
            raise ReplayError(f"{metrics}: step {only} has no batch/hash (see log.batch_hashes, log.interval)")
        logged = {only: logged[only]}
    if not logged:
        raise ReplayError(f"{metrics}: no step logged batch/hash; train with log.batch_hashes = true")
    steps, console = RunSteps(run_dir), Console(highlight=False)
    for step, expected in sorted(logged.items()):
        found = step_hash([micro_batch_hash(mb) for mb in steps.micro_batches(step)])
        if found != expected:
            console.print(f"step {step}: the replayed data hashes to {found:012x}, the run logged {expected:012x}: "
                          "the data, the tokenizer or the config changed since")  # fmt: skip
            return 1
    console.print(f"{len(logged)} steps verified: their replayed data hashes to what the run logged")
    return 0


def _document(run_dir: Path, document: str) -> int:
    from rich.console import Console
    from rich.markup import escape

    from lmforge.eval.step_documents import RunSteps

    steps = RunSteps(run_dir)
    found = steps.document_steps(document)
    console = Console(highlight=False)
    last = steps.last_step()
    if not found:
        console.print(f"{escape(document)} was not trained on in steps 1..{last}")
        return 0
    times = "once" if len(found) == 1 else f"{len(found)} times"
    epochs = {f["epoch"] for f in found if "epoch" in f}
    across = f" across {len(epochs)} epochs" if len(epochs) > 1 else ""
    console.print(f"{escape(document)} was trained on {times}{across} in steps 1..{last}:")
    for f in found:
        where = f", window {f['window']} (epoch {f['epoch']})" if "window" in f else ""
        console.print(f"  step {f['step']}, micro-batch {f['micro_batch']}{where}")
    return 0


def _list(args: Any) -> int:
    from lmforge.checkpoint.layout import data_position_before
    from lmforge.data.batch_hash import step_hash
    from lmforge.data.replay import ReplayError
    from lmforge.eval.step_documents import RunSteps, describe_batch, top_documents
    from lmforge.monitor.jsonl import read_metrics

    steps = RunSteps(args.run_dir)
    batches = steps.replay(args.step)
    shown = batches
    if args.micro_batch is not None:
        if not 0 <= args.micro_batch < len(batches):
            raise ReplayError(
                f"--micro-batch {args.micro_batch}: step {args.step} has micro-batches 0..{len(batches) - 1}"
            )
        shown = [batches[args.micro_batch]]
    anchor, _ = data_position_before(args.run_dir, args.step)
    described = [describe_batch(b, steps.tokenizer, args.chars) for b in shown]  # type: ignore[arg-type]
    listing: dict[str, Any] = {
        "run": str(args.run_dir),
        "step": args.step,
        "data_type": steps.config.data.type,
        "from_checkpoint": anchor or None,
        "micro_batches_in_step": len(batches),
        "batch_hash": step_hash([b.hash for b in batches]),
        "micro_batches": described,
    }
    if args.score:
        score = steps.score(shown, described, steps.scoring_checkpoint(args.step, args.checkpoint))
        logged = [
            r for r in read_metrics(args.run_dir / "metrics.jsonl") if r["step"] == args.step and "loss/mean" in r
        ]
        if len(shown) == len(batches) and logged:
            score["logged_loss_mean"], score["logged_loss_tokens"] = logged[-1]["loss/mean"], logged[-1]["loss/tokens"]
        score["top"] = top_documents(described, args.top)
        listing["score"] = score
    _print(listing)
    if args.json is not None:
        args.json.write_text(json.dumps(listing, indent=1) + "\n", encoding="utf-8")
    return 0


def _print(listing: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    origin = f"checkpoint step_{listing['from_checkpoint']}" if listing["from_checkpoint"] else "the start of the run"
    count = listing["micro_batches_in_step"]
    head = f"step {listing['step']} of {escape(listing['run'])}: {count} micro-batches ({listing['data_type']} data"
    console.print(f"[bold]{head}, position from {origin}), batch hash {listing['batch_hash']:012x}[/]")
    score = listing.get("score")
    for mb in listing["micro_batches"]:
        console.print(f"\n[bold]micro-batch {mb['index']}[/]: {mb['loss_tokens']} loss tokens, hash {mb['hash']:012x}")
        for row in mb["rows"]:
            console.print(f"  {escape(row['row'])}")
            for d in row["documents"]:
                cut = " and ".join(name for name, on in (("start", d["cut_before"]), ("end", d["cut_after"])) if on)
                facts = [f"[{d['source']}]" if d["source"] else "", f"tokens {d['span'][0]}-{d['span'][1]}",
                         f"{d['loss_tokens']} loss tokens", f"cut at its {cut}" if cut else ""]  # fmt: skip
                if "loss_sum" in d:
                    facts.append(f"loss {d['loss_sum']:.2f} (mean {d['loss_mean']:.3f})")
                console.print(f"    [cyan]{escape(d['where'])}[/] " + escape(", ".join(f for f in facts if f)))
                # Trained text in bold, context dim: what an SFT row trains on stands out. One line per document.
                text = "".join(f"[bold]{_line(s['text'])}[/]" if s["loss"] else f"[dim]{_line(s['text'])}[/]"
                               for s in d["segments"])  # fmt: skip
                console.print(f"      {text}")
    if score is not None:
        _print_score(console, listing["step"], score)


def _line(text: str) -> str:
    """`text` escaped for rich markup, with its line breaks shown as ⏎."""
    from rich.markup import escape

    return escape(text.replace("\r\n", "⏎").replace("\n", "⏎"))


def _print_score(console: Any, step: int, score: dict[str, Any]) -> None:
    from rich.markup import escape

    line = (f"\n[bold]scored with checkpoint step_{score['checkpoint']}[/]: {score['loss_sum']:.4f} nats over "
            f"{score['loss_tokens']} loss tokens, mean {score['loss_mean']:.4f}")  # fmt: skip
    if "logged_loss_mean" in score:
        line += f"; step {step} logged loss/mean {score['logged_loss_mean']:.4f} over {score['logged_loss_tokens']:.0f}"
    console.print(line)
    console.print(f"[bold]top {len(score['top'])} documents by summed loss[/]")
    for d in score["top"]:
        source = f" [{d['source']}]" if d["source"] else ""
        console.print(f"  {d['loss_sum']:9.2f}  mean {d['loss_mean']:.3f}  {d['loss_tokens']:5d} tokens  "
                      f"micro-batch {d['micro_batch']}  [cyan]{escape(d['where'])}[/]{escape(source)}")  # fmt: skip
        console.print(f"      {_line(d['text'])}")
