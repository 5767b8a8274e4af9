"""Local text -> datatrove token shards, written by datatrove's own `DocumentTokenizer` (`lmforge tokenize`).

Documents come from `text_sources` through a small reader step; datatrove's `LocalPipelineExecutor` (or, with
`--slurm`, its `SlurmPipelineExecutor`: `prep/tokenize_slurm.py`) runs `--tasks` tasks, each reading a disjoint
share of the documents and writing its own shard files. An optional holdout split is drawn
per document from (seed, document id) before tokenizing, so it does not depend on the number of tasks.
datatrove's logs and stats go to `<output>/.datatrove/`; shard readers only look at top-level `*.ds` files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.tokens import DocumentTokenizer
from datatrove.utils.logging import logger

from lmforge.data.tokenizer import load_tokenizer
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


def summary_line(label: str, summary: ShardSummary, folder: Path) -> str:
    """The line `lmforge tokenize` prints for one output folder."""
    return f"{label}: {summary.documents} documents, {summary.tokens} tokens, {summary.files} files -> {folder}"


def summarize_shards(folder: Path) -> ShardSummary:
    """Count the `*.ds` files at the top level of `folder` and their documents and tokens (from index and metadata)."""
    files = documents = tokens = 0
    for ds in sorted(folder.glob("*.ds")):
        files += 1
        documents += (ds.parent / f"{ds.name}.index").stat().st_size // np.dtype(np.uint64).itemsize
        lines = (ds.parent / f"{ds.name}.metadata").read_text(encoding="utf-8").splitlines()
        tokens += int(lines[1])
    return ShardSummary(files, documents, tokens)


def _remove_empty_shards(folder: Path, prefix: str) -> None:
    # A task that got no documents leaves a 0-token file behind (and a split at --max-tokens-per-file can too);
    # a reader that checks the first document of every file for EOS would reject it, and it holds nothing.
    for ds in folder.glob(f"{prefix}*.ds"):
        if ds.stat().st_size == 0:
            for suffix in _SHARD_SUFFIXES:
                (folder / f"{ds.name.removesuffix('.ds')}{suffix}").unlink(missing_ok=True)


class DropEmptyShards(PipelineStep):
    """datatrove pipeline step after the tokenizer: removes the empty shard files of its own task, so the folder
    looks the same whichever executor (local or Slurm) ran the tasks."""

    name = "lmforge empty-shard sweep"
    type = "🧹 - CLEANUP"

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        """Let the steps before finish, then delete this task's empty files (its files start with its rank)."""
        if data is not None:
            for _ in data:
                pass
        _remove_empty_shards(self.folder, f"{rank:05d}_")
        yield from ()


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


def tokenize_pipeline(
    job: TokenizeJob,
    files: list[InputFile],
    text_key: str,
    tokenizer_file: Path,
    eos_token: str,
    seed: int,
    max_tokens_per_file: int | None,
) -> list[PipelineStep]:
    """The datatrove steps of one job: read this task's documents, tokenize them into shards, drop empty files."""
    reader = TextReader(files, text_key, job.split, job.label)
    writer = DocumentTokenizer(
        output_folder=str(job.output),
        tokenizer_name_or_path=str(tokenizer_file),
        eos_token=eos_token,
        max_tokens_per_file=max_tokens_per_file,
        seed=seed,
        shuffle_documents=True,
    )
    return [reader, writer, DropEmptyShards(job.output)]


def run_tokenize_job(pipeline: list[PipelineStep], output: Path, tasks: int, workers: int) -> ShardSummary:
    """Run one job's pipeline on this machine with datatrove's local executor; returns what its folder holds."""
    executor = LocalPipelineExecutor(
        pipeline=pipeline,
        tasks=tasks,
        workers=workers,
        logging_dir=str(output / LOG_DIR_NAME),
        # The folder was emptied before, so there is nothing to resume; never skip a task on a stale marker.
        skip_completed=False,
    )
    executor.run()
    return summarize_shards(output)


def _cpu_count() -> int:
    # The affinity mask is what this process may use (containers, taskset), not the machine's total.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def tokenize_jobs(output: Path, seed: int, holdout: float | None, holdout_output: Path | None) -> list[TokenizeJob]:
    """The jobs of one tokenize run: every document into `output`, or, with a holdout fraction, the documents
    drawn for the holdout into `holdout_output` and the rest into `output`."""
    if holdout is None or holdout_output is None:
        return [TokenizeJob("train", "--output", output, None)]
    return [
        TokenizeJob("train", "--output", output, Split(seed, holdout, holdout=False)),
        TokenizeJob("holdout", "--holdout-output", holdout_output, Split(seed, holdout, holdout=True)),
    ]


def _check_options(
    output: Path,
    tasks: int,
    workers: int | None,
    max_tokens_per_file: int | None,
    holdout: float | None,
    holdout_output: Path | None,
) -> None:
    # Messages name the command-line option of each value: the command passes them through as they are.
    if tasks < 1:
        raise SourceError(f"--tasks {tasks}: must be at least 1")
    if workers is not None and workers < 1:
        raise SourceError(f"--workers {workers}: must be at least 1")
    if max_tokens_per_file is not None and max_tokens_per_file < 1:
        raise SourceError(f"--max-tokens-per-file {max_tokens_per_file}: must be at least 1")
    if (holdout is None) != (holdout_output is None):
        raise SourceError("--holdout and --holdout-output go together: give both or neither")
    if holdout is not None and holdout_output is not None:
        if not 0.0 < holdout < 1.0:
            raise SourceError(f"--holdout {holdout}: must be a fraction strictly between 0 and 1")
        if holdout_output.resolve() == output.resolve():
            raise SourceError(f"--holdout-output {holdout_output}: must differ from --output")


@dataclass(frozen=True)
class TokenizePlan:
    """A checked tokenize run, its output folders ready: the jobs and the steps of each."""

    jobs: list[TokenizeJob]
    """The output folders (train, and holdout when drawn)."""
    pipelines: list[list[PipelineStep]]
    """The datatrove steps of each job, in the order of `jobs`."""
    tasks: int
    """datatrove tasks per job, each writing its own files."""
    workers: int | None
    """Tasks run at once; None: min(tasks, usable CPUs) on this machine, no limit on Slurm."""


def plan_tokenize(
    inputs: Sequence[Path],
    tokenizer: Path,
    output: Path,
    *,
    text_key: str = "text",
    tasks: int = 1,
    workers: int | None = None,
    max_tokens_per_file: int | None = None,
    seed: int = 0,
    holdout: float | None = None,
    holdout_output: Path | None = None,
    overwrite: bool = False,
) -> TokenizePlan:
    """Check the options, the tokenizer, the inputs and the output folders (see `prepare_outputs`), then empty or
    create the folders and build each job's pipeline: every document of `inputs` into `output`, or, with a
    `holdout` fraction in (0, 1), the held-out documents into `holdout_output` and the rest into `output`.
    `tokenizer` is a tokenizer folder or `tokenizer.json`. Raises `SourceError` or `TokenizerError` for bad input,
    before any folder is touched."""
    _check_options(output, tasks, workers, max_tokens_per_file, holdout, holdout_output)
    jobs = tokenize_jobs(output, seed, holdout, holdout_output)
    info = load_tokenizer(tokenizer)
    files = list_input_files(list(inputs))
    prepare_outputs({job.flag: job.output for job in jobs}, overwrite)
    pipelines = [
        tokenize_pipeline(job, files, text_key, info.path.resolve(), info.eos_token, seed, max_tokens_per_file)
        for job in jobs
    ]
    return TokenizePlan(jobs, pipelines, tasks, workers)


def clear_outputs(plan: TokenizePlan) -> None:
    """Delete everything a failed run wrote into the output folders (they were empty or cleared before it)."""
    for job in plan.jobs:
        _clear(job.output)


def tokenize_corpus(plan: TokenizePlan) -> list[tuple[TokenizeJob, ShardSummary]]:
    """Run a plan's jobs on this machine (datatrove's local executor); returns each job with what its folder then
    holds. An input error met while tokenizing (`SourceError`) clears the output folders again, so a fixed rerun
    needs no `overwrite`."""
    workers = plan.workers if plan.workers is not None else min(plan.tasks, _cpu_count())
    results: list[tuple[TokenizeJob, ShardSummary]] = []
    try:
        for job, pipeline in zip(plan.jobs, plan.pipelines, strict=True):
            results.append((job, run_tokenize_job(pipeline, job.output, plan.tasks, workers)))
    except SourceError:
        clear_outputs(plan)
        raise
    return results
