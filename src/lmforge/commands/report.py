"""`lmforge report RUN_DIR -o report.html [--smoothing 0.9] [--spikes [--top K]]`: one self-contained HTML page
about a run.

The page is made by `lmforge.viz.report.write_report`; this module maps flags onto it and prints what it wrote.
With `--spikes` it first replays each flagged step and scores its documents with the checkpoint before it
(`lmforge.eval.step_documents`), so the page lists the documents behind every spike.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lmforge.commands.errors import CommandParser, fail, parse_args
from lmforge.viz.report import DEFAULT_SMOOTHING, write_report
from lmforge.viz.runs import RunError, load_run
from lmforge.viz.spikes import Spike, flagged_steps

USAGE = "lmforge report RUN_DIR -o report.html [--smoothing 0.9] [--spikes [--top K] [--max-spikes N]]"


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="lmforge report",
        usage=USAGE,
        description="Write one self-contained HTML page about a run: its curves, a summary and its config.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir")
    parser.add_argument("-o", "--output", type=Path, required=True, help="HTML file to write")
    parser.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        help=f"EMA weight in [0, 1) of the smoothed loss line (default {DEFAULT_SMOOTHING})",
    )
    parser.add_argument(
        "--spikes",
        action="store_true",
        help="replay every flagged step and list its documents of highest loss under the checkpoint before it "
        "(loads the model; needs the run's data)",
    )
    parser.add_argument("--top", type=int, default=5, help="documents listed per spike (default 5)")
    parser.add_argument("--max-spikes", type=int, default=20, help="spikes replayed, the first ones (default 20)")
    return parser


def replay_spikes(run_dir: Path, top: int, most: int) -> list[Spike]:
    """The run's flagged steps, the first `most` of them with their `top` documents of highest summed loss; a step
    that cannot be replayed or scored says why instead."""
    from lmforge.checkpoint.layout import CheckpointError
    from lmforge.config import ConfigError
    from lmforge.config.hf_config import HFModelError
    from lmforge.data.replay import ReplayError
    from lmforge.data.stream import DataError
    from lmforge.eval.step_documents import RunSteps, describe_batch, top_documents

    spikes = flagged_steps(load_run(run_dir))
    try:
        steps = RunSteps(run_dir)
    except (ConfigError, *DataError) as e:
        return [replace(s, note=f"not replayed: {e}") for s in spikes]
    out = []
    for i, spike in enumerate(spikes):
        if i >= most:
            out.append(replace(spike, note=f"not replayed: --max-spikes {most}"))
            continue
        try:
            batches = steps.replay(spike.step)
            described = [describe_batch(b, steps.tokenizer, 300) for b in batches]  # type: ignore[arg-type]
            checkpoint = steps.scoring_checkpoint(spike.step)
            score = steps.score(batches, described, checkpoint)
        except (ReplayError, CheckpointError, HFModelError, *DataError, OSError) as e:
            out.append(replace(spike, note=f"not replayed: {e}"))
            continue
        exact = "the step before" if checkpoint == spike.step - 1 else f"{spike.step - 1 - checkpoint} steps earlier"
        note = (f"scored with checkpoint step_{checkpoint} ({exact}): {score['loss_mean']:.4f} mean loss over "
                f"{score['loss_tokens']} targets; the {top} documents of highest summed loss")  # fmt: skip
        out.append(replace(spike, documents=top_documents(described, top), note=note))
    return out


def main(argv: list[str]) -> int:
    """Run `lmforge report` with the arguments after `report`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    # Checked before the run is read, so a bad flag is reported even for a run directory that is also wrong.
    if not 0.0 <= args.smoothing < 1.0:
        return fail("report", f"--smoothing must be in [0, 1), got {args.smoothing}")
    if args.top < 1 or args.max_spikes < 1:
        return fail("report", "--top and --max-spikes must be at least 1")
    try:
        spikes = replay_spikes(Path(args.run_dir), args.top, args.max_spikes) if args.spikes else None
        write_report(args.run_dir, args.output, args.smoothing, spikes)
    except RunError as e:
        return fail("report", str(e))
    except OSError as e:  # an --output that is a folder, or lies under a file; the message names the path
        return fail("report", f"{e.filename or args.output}: {e.strerror or e}")
    print(f"wrote {args.output}")
    return 0
