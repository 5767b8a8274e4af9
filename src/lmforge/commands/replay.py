"""`lmforge replay RUN --step N [--micro-batch I] [--score [--checkpoint K] [--top T]] [--json FILE] [--chars C]` and
`lmforge replay RUN --verify`.

Replay rebuilds, in one process and from the run directory alone (its config.toml, the data and tokenizer it names,
and its checkpoints' data positions), the micro-batches a step trained on, and lists the documents in each
(`lmforge.data.replay`). `--score` adds each document's loss under a checkpoint's weights
(`lmforge.eval.document_loss`) and lists the documents with the highest summed loss. `--verify` recomputes the
`batch/hash` each logged step recorded (`log.batch_hashes`) and names the first step whose data differs.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.commands.errors import CommandParser, fail, parse_args

USAGE = (
    "lmforge replay RUN_DIR --step N [--micro-batch I] [--score [--checkpoint K] [--top T]] [--json FILE] [--chars C]"
    " | RUN_DIR --verify [--step N]"
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
    if not args.verify and args.step is None:
        return fail("replay", "give --step N (the step to list) or --verify")
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
        return _list(args)
    except (ConfigError, CheckpointError, HFModelError, ReplayError, *DataError) as e:
        return fail("replay", str(e))
    except OSError as e:
        return fail("replay", f"{e.filename or args.run_dir}: {e.strerror or e}")


class _Streams:
    """One-process data streams of a run, moved to any step from the nearest earlier data position."""

    def __init__(self, run_dir: Path) -> None:
        from lmforge.data.tokenizer import load_tokenizer
        from lmforge.eval.worker import read_run_config

        self.run_dir = run_dir
        self.config = read_run_config(run_dir)
        name = self.config.tokenizer.name
        self.tokenizer = load_tokenizer(name) if name else None
        self._stream: Any = None
        self._at = (-1, -1)  # (step of the position it started from, steps it has gone past)

    def at(self, step: int) -> Any:
        """The stream positioned at the start of `step`."""
        from lmforge.checkpoint.layout import data_position_before
        from lmforge.data.replay import ReplayError, seek
        from lmforge.data.stream import build_step_data

        if step > self.config.max_steps:
            raise ReplayError(f"--step {step}: the run has max_steps = {self.config.max_steps}")
        anchor, position = data_position_before(self.run_dir, step)
        if self._stream is None or self._at[0] != anchor or self._at[1] > step - 1:
            self._stream = build_step_data(self.config.data, 0, 1, self.tokenizer)
            seek(self._stream, position, step - 1 - anchor)
        else:
            seek(self._stream, None, step - 1 - self._at[1])
        self._at = (anchor, step)
        return self._stream


def _verify(run_dir: Path, only: int | None) -> int:
    from rich.console import Console

    from lmforge.data.batch_hash import micro_batch_hash, step_hash
    from lmforge.data.replay import ReplayError
    from lmforge.monitor.jsonl import read_metrics

    metrics = run_dir / "metrics.jsonl"
    logged = {int(r["step"]): int(r["batch/hash"]) for r in read_metrics(metrics) if "batch/hash" in r}
    if only is not None:
        if only not in logged:
            raise ReplayError(f"{metrics}: step {only} has no batch/hash (see log.batch_hashes, log.interval)")
        logged = {only: logged[only]}
    if not logged:
        raise ReplayError(f"{metrics}: no step logged batch/hash; train with log.batch_hashes = true")
    streams, console = _Streams(run_dir), Console()
    for step, expected in sorted(logged.items()):
        found = step_hash([micro_batch_hash(mb) for mb in streams.at(step).next_step()])
        if found != expected:
            console.print(f"step {step}: the replayed data hashes to {found:012x}, the run logged {expected:012x}: "
                          "the data, the tokenizer or the config changed since", highlight=False)  # fmt: skip
            return 1
    console.print(f"{len(logged)} steps verified: their replayed data hashes to what the run logged", highlight=False)
    return 0


def _list(args: Any) -> int:
    from lmforge.checkpoint.layout import data_position_before
    from lmforge.data.batch_hash import step_hash
    from lmforge.data.replay import ReplayError, replay_next_step

    streams = _Streams(args.run_dir)
    batches = replay_next_step(streams.at(args.step))
    shown = batches
    if args.micro_batch is not None:
        if not 0 <= args.micro_batch < len(batches):
            raise ReplayError(
                f"--micro-batch {args.micro_batch}: step {args.step} has micro-batches 0..{len(batches) - 1}"
            )
        shown = [batches[args.micro_batch]]
    anchor, _ = data_position_before(args.run_dir, args.step)
    listing = {
        "run": str(args.run_dir),
        "step": args.step,
        "data_type": streams.config.data.type,
        "from_checkpoint": anchor or None,
        "micro_batches_in_step": len(batches),
        "batch_hash": step_hash([b.hash for b in batches]),
        "micro_batches": [_describe(b, streams.tokenizer, args.chars) for b in shown],
    }
    if args.score:
        listing["score"] = _score(args, streams, shown, listing["micro_batches"], len(shown) == len(batches))
    _print(listing)
    if args.json is not None:
        args.json.write_text(json.dumps(listing, indent=1) + "\n", encoding="utf-8")
    return 0


def _score(args: Any, streams: _Streams, batches: list[Any], described: list[dict[str, Any]],
           whole: bool) -> dict[str, Any]:  # fmt: skip
    """Score `batches` with the chosen checkpoint; adds `loss_sum` and `loss_mean` to each described document and
    returns the summary: the checkpoint, the documents' totals, the logged loss of the step, the top documents."""
    import torch

    from lmforge.checkpoint.layout import CHECKPOINTS, list_checkpoints, step_name
    from lmforge.data.replay import ReplayError
    from lmforge.eval.document_loss import score_documents
    from lmforge.hf.folder import load_pretrained
    from lmforge.monitor.jsonl import read_metrics

    root = args.run_dir / CHECKPOINTS
    steps = list_checkpoints(root)
    if args.checkpoint is None:
        earlier = [s for s in steps if s <= args.step - 1]
        if not earlier:
            raise ReplayError(f"--score: {root} has no complete checkpoint at or before step {args.step - 1} "
                              f"(complete checkpoints: {', '.join(map(str, steps)) or 'none'})")  # fmt: skip
        args.checkpoint = earlier[-1]
    elif args.checkpoint not in steps:
        raise ReplayError(f"--checkpoint {args.checkpoint}: no complete checkpoint {root / step_name(args.checkpoint)} "
                          f"(complete checkpoints: {', '.join(map(str, steps)) or 'none'})")  # fmt: skip
    model, _ = load_pretrained(root / step_name(args.checkpoint), attn=streams.config.model.attn)
    losses = score_documents(model, batches, torch.device("cpu"))
    documents = [d for mb in described for row in mb["rows"] for d in row["documents"]]
    for doc, scored in zip(documents, losses, strict=True):
        doc["loss_sum"], doc["loss_mean"] = scored.loss_sum, scored.loss_mean
    total, tokens = sum(d.loss_sum for d in losses), sum(d.piece.loss_tokens for d in losses)
    summary: dict[str, Any] = {"checkpoint": args.checkpoint, "loss_sum": total, "loss_tokens": tokens,
                               "loss_mean": total / tokens if tokens else float("nan")}  # fmt: skip
    logged = [r for r in read_metrics(args.run_dir / "metrics.jsonl") if r["step"] == args.step and "loss/mean" in r]
    if whole and logged:
        summary["logged_loss_mean"], summary["logged_loss_tokens"] = logged[-1]["loss/mean"], logged[-1]["loss/tokens"]
    ranked = sorted(range(len(documents)), key=lambda i: -losses[i].loss_sum)[: args.top]
    summary["top"] = [{"micro_batch": losses[i].batch, **documents[i]} for i in ranked]
    return summary


def _describe(batch: Any, tokenizer: Any, chars: int) -> dict[str, Any]:
    rows = []
    for row in batch.rows:
        documents = []
        for p in row.pieces:
            segments = _segments(p.token_ids, p.loss, tokenizer, chars)
            documents.append({
                "where": p.where,
                "source": p.source,
                "span": [p.start, p.start + len(p.token_ids)],
                "tokens": len(p.token_ids),
                "cut_before": p.cut_before,
                "cut_after": p.cut_after,
                "loss_tokens": p.loss_tokens,
                "text": "".join(s["text"] for s in segments),
                "segments": segments,
            })  # fmt: skip
        rows.append({"row": row.label, "documents": documents})
    return {"index": batch.index, "hash": batch.hash, "loss_tokens": int(batch.batch.loss_mask.sum()), "rows": rows}


def _segments(ids: np.ndarray, loss: np.ndarray, tokenizer: Any, chars: int) -> list[dict[str, Any]]:
    """The part's text (its first `chars` characters; 0: all) in runs of tokens that are, or are not, loss targets,
    so an SFT row shows what it trains on."""
    cuts = [0, *(np.flatnonzero(np.diff(loss.astype(np.int8))) + 1).tolist(), len(ids)]
    runs, left = [], chars or None
    for a, b in itertools.pairwise(cuts):
        if b == a:
            continue
        text = tokenizer.tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        if left is not None:
            text, left = (text, left - len(text)) if len(text) < left else (text[:left] + "…", 0)
        runs.append({"loss": bool(loss[a]), "text": text})
        if left == 0:
            break
    return runs


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

