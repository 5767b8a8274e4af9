"""`lmforge tokenize`: local text -> datatrove token shards, written by datatrove's own `DocumentTokenizer`.

Documents come from `text_sources` through a small reader step; datatrove's `LocalPipelineExecutor` runs `--tasks`
tasks, each reading a disjoint share of the documents and writing its own shard files. An optional holdout split
is drawn per document from (seed, document id) before tokenizing, so it does not depend on the number of tasks.
datatrove's logs and stats go to `<output>/.datatrove/`; shard readers only look at top-level `*.ds` files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.tokens import DocumentTokenizer
from datatrove.utils.logging import logger

from lmforge.data.tokenizer import TokenizerError, load_tokenizer
from lmforge.prep.command import parse_args, usage_error
from lmforge.prep.text_sources import InputFile, SourceError, iter_file_documents, list_input_files

LOG_DIR_NAME = ".datatrove"
_SHARD_SUFFIXES = (".ds", ".ds.index", ".ds.metadata", ".ds.loss")


def in_holdout(doc_id: str, seed: int, fraction: float) -> bool:
    """Whether a document belongs to the holdout split: a hash of (seed, id) mapped to [0, 1) is below `fraction`.

    Depends only on the seed and the document id, never on the number of tasks or the order of reading.
    """
    digest = hashlib.blake2b(f"{seed}\0{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def task_share(files: list[InputFile], rank: int, world_size: int) -> list[tuple[InputFile, tuple[int, int]]]:
    """The files (and row shard of each) that task `rank` of `world_size` reads; the tasks' shares are disjoint.

    With at least as many files as tasks, whole files go round-robin to tasks. With fewer, every task reads every
    file but only the rows congruent to its rank, so a single large file still spreads over all tasks.
    """
    if len(files) >= world_size:
        return [(file, (0, 1)) for file in files[rank::world_size]]
    return [(file, (rank, world_size)) for file in files]


@dataclass(frozen=True)
class Split:
    """Which documents a reader keeps when a holdout is drawn."""

    seed: int
    fraction: float
    holdout: bool
    """True: keep the holdout documents; False: keep the others."""


class TextReader(PipelineStep):
    """datatrove pipeline step that yields this task's share of the input documents as `Document`s."""

    name = "lmforge text reader"
    type = "📖 - READER"

    def __init__(self, files: list[InputFile], text_key: str, split: Split | None, label: str) -> None:
        super().__init__()
        self.files = files
        self.text_key = text_key
        self.split = split
        self.label = label

    def _keep(self, doc_id: str) -> bool:
        if self.split is None:
            return True
        return in_holdout(doc_id, self.split.seed, self.split.fraction) == self.split.holdout

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        """Yield the documents of task `rank`; a `SourceError` ends the task with a one-line log message."""
        count = 0
        try:
            for file, shard in task_share(self.files, rank, world_size):
                for doc_id, text in iter_file_documents(file, self.text_key, shard):
                    if self._keep(doc_id):
                        count += 1
                        self.stat_update("documents")
                        yield Document(text=text, id=doc_id)
        except SourceError as e:
            logger.error(f"{self.label} task {rank}: {e}")
            # datatrove logs any task exception with a full traceback; bad input is the user's to fix and the
            # command prints it as one line, so the handlers go (datatrove re-adds its default one afterwards).
            logger.remove()
            raise
        print(f"{self.label}: task {rank + 1}/{world_size} read {count} documents", flush=True)


@dataclass(frozen=True)
class ShardSummary:
    """What a folder of token shards holds."""

    files: int
    documents: int
    tokens: int


def summarize_shards(folder: Path) -> ShardSummary:
    """Count the `*.ds` files at the top level of `folder` and their documents and tokens (from index and metadata)."""
    files = documents = tokens = 0
    for ds in sorted(folder.glob("*.ds")):
        files += 1
        documents += (ds.parent / f"{ds.name}.index").stat().st_size // np.dtype(np.uint64).itemsize
        lines = (ds.parent / f"{ds.name}.metadata").read_text(encoding="utf-8").splitlines()
        tokens += int(lines[1])
    return ShardSummary(files, documents, tokens)


def _remove_empty_shards(folder: Path) -> None:
    # A task that got no documents leaves a 0-token file behind (and a split at --max-tokens-per-file can too);
    # a reader that checks the first document of every file for EOS would reject it, and it holds nothing.
    for ds in folder.glob("*.ds"):
        if ds.stat().st_size == 0:
            for suffix in _SHARD_SUFFIXES:
                (folder / f"{ds.name.removesuffix('.ds')}{suffix}").unlink(missing_ok=True)


def _is_ours(entry: Path) -> bool:
    return entry.name == LOG_DIR_NAME or (entry.is_file() and entry.name.endswith(_SHARD_SUFFIXES))


def _clear(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def prepare_outputs(folders: dict[str, Path], overwrite: bool) -> None:
    """Create each output folder (keyed by its flag), or make sure it is empty: refuse a non-empty one without
    `overwrite`, else clear it.

    Only token shards and datatrove logs are cleared; a folder holding anything else is refused even with
    `overwrite`, so a mistyped path never deletes unrelated files. Every folder is checked before any is cleared.
    Raises `SourceError`.
    """
    to_clear = []
    for flag, folder in folders.items():
        if folder.exists() and not folder.is_dir():
            raise SourceError(f"{flag} {folder}: exists and is not a folder")
        if folder.is_dir() and any(folder.iterdir()):
            if not overwrite:
                raise SourceError(f"{flag} {folder}: folder is not empty (pass --overwrite to replace its shards)")
            foreign = sorted(e.name for e in folder.iterdir() if not _is_ours(e))
            if foreign:
                raise SourceError(f"{flag} {folder}: holds files that are not token shards {foreign[:3]}; not clearing")
            to_clear.append(folder)
    for folder in to_clear:
        _clear(folder)
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class TokenizeJob:
    """One output folder to tokenize into, and which documents go there."""

    label: str
    """`train` or `holdout`, as printed."""
    flag: str
    """The option that named the folder, for error messages."""
    output: Path
    """The shard folder."""
    split: Split | None
    """Which side of the holdout draw to keep; None keeps every document."""


def run_tokenize_job(
    job: TokenizeJob,
    files: list[InputFile],
    text_key: str,
    tokenizer_file: Path,
    eos_token: str,
    tasks: int,
    workers: int,
    seed: int,
    max_tokens_per_file: int | None,
) -> ShardSummary:
    """Tokenize the job's documents into `job.output` with datatrove; returns what the folder then holds."""
    reader = TextReader(files, text_key, job.split, job.label)
    writer = DocumentTokenizer(
        output_folder=str(job.output),
        tokenizer_name_or_path=str(tokenizer_file),
        eos_token=eos_token,
        max_tokens_per_file=max_tokens_per_file,
        seed=seed,
        shuffle_documents=True,
    )
    executor = LocalPipelineExecutor(
        pipeline=[reader, writer],
        tasks=tasks,
        workers=workers,
        logging_dir=str(job.output / LOG_DIR_NAME),
        # The folder was emptied before, so there is nothing to resume; never skip a task on a stale marker.
        skip_completed=False,
    )
    executor.run()
    _remove_empty_shards(job.output)
    return summarize_shards(job.output)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge tokenize",
        description="Tokenize local text into datatrove token shards (.ds, .ds.index, .ds.metadata).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="text files, folders of them, .jsonl or .parquet files")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder or tokenizer.json")
    parser.add_argument("--output", type=Path, required=True, help="folder for the token shards")
    parser.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--tasks", type=int, default=1, help="datatrove tasks, each writes its own files")
    parser.add_argument("--workers", type=int, default=None, help="tasks run at once (default min(tasks, CPUs))")
    parser.add_argument("--max-tokens-per-file", type=int, default=None, help="split a task's output into files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document shuffle and the holdout draw")
    parser.add_argument("--holdout", type=float, default=None, help="fraction of documents to hold out, in (0, 1)")
    parser.add_argument("--holdout-output", type=Path, default=None, help="folder for the holdout shards")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards in existing output folders")
    return parser


def _cpu_count() -> int:
    # The affinity mask is what this process may use (containers, taskset), not the machine's total.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_args(args: argparse.Namespace) -> None:
    if args.tasks < 1:
        raise SourceError(f"--tasks {args.tasks}: must be at least 1")
    if args.workers is not None and args.workers < 1:
        raise SourceError(f"--workers {args.workers}: must be at least 1")
    if args.max_tokens_per_file is not None and args.max_tokens_per_file < 1:
        raise SourceError(f"--max-tokens-per-file {args.max_tokens_per_file}: must be at least 1")
    if (args.holdout is None) != (args.holdout_output is None):
        raise SourceError("--holdout and --holdout-output go together: give both or neither")
    if args.holdout is not None:
        if not 0.0 < args.holdout < 1.0:
            raise SourceError(f"--holdout {args.holdout}: must be a fraction strictly between 0 and 1")
        if args.holdout_output.resolve() == args.output.resolve():
            raise SourceError(f"--holdout-output {args.holdout_output}: must differ from --output")


def _jobs(args: argparse.Namespace) -> list[TokenizeJob]:
    if args.holdout is None:
        return [TokenizeJob("train", "--output", args.output, None)]
    return [
        TokenizeJob("train", "--output", args.output, Split(args.seed, args.holdout, holdout=False)),
        TokenizeJob("holdout", "--holdout-output", args.holdout_output, Split(args.seed, args.holdout, holdout=True)),
    ]


def _error(message: str) -> int:
    return usage_error("lmforge tokenize", message)


def tokenize_main(argv: list[str]) -> int:
    """Run `lmforge tokenize` with the arguments after `tokenize`; returns the exit code (2 for bad input)."""
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        _check_args(args)
        jobs = _jobs(args)
        info = load_tokenizer(args.tokenizer)
        files = list_input_files(args.inputs)
        prepare_outputs({job.flag: job.output for job in jobs}, args.overwrite)
    except (SourceError, TokenizerError) as e:
        return _error(str(e))
    workers = args.workers if args.workers is not None else min(args.tasks, _cpu_count())
    summaries: dict[str, ShardSummary] = {}
    try:
        for job in jobs:
            summaries[job.label] = run_tokenize_job(
                job,
                files,
                args.text_key,
                info.path.resolve(),
                info.eos_token,
                args.tasks,
                workers,
                args.seed,
                args.max_tokens_per_file,
            )
    except SourceError as e:
        # Everything in the output folders was written by this run (they were empty or cleared): drop the
        # partial shards so a fixed rerun does not need --overwrite.
        for job in jobs:
            _clear(job.output)
        return _error(str(e))
    for job in jobs:
        s = summaries[job.label]
        print(f"{job.label}: {s.documents} documents, {s.tokens} tokens, {s.files} files -> {job.output}")
        if s.documents == 0:
            print(f"warning: {job.label} got no documents", file=sys.stderr)
    return 0
