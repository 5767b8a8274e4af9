"""`[val]`: held-out sets scored while training."""

from __future__ import annotations

from pydantic import Field, field_validator

from lmforge.config.base import Section


def check_path_name(value: str) -> str:
    """`value` itself when it can safely become one component of a file path (lmforge writes files named after it,
    or services put it in paths of theirs): not empty, not `.` or `..`, and without a path separator, so it can
    never reach outside the folder it is joined to; else ValueError."""
    if not value.strip():
        raise ValueError("must not be empty")
    if "/" in value or "\\" in value or "\0" in value:
        raise ValueError("must be a plain name, without '/', '\\' or NUL: it becomes part of a path")
    if value in (".", ".."):
        raise ValueError("must be a plain name, not '.' or '..': it becomes part of a path")
    return value


class ValSetConfig(Section):
    """One held-out token folder."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of the set in metric keys: `val/<name>/<metric>@<length>`; letters, digits, `_`, `.` and `-`, not `.`
    or `..`."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return check_path_name(value)

    path: str
    """Folder of datatrove token shards (made with the run's tokenizer, e.g. `lmforge tokenize --holdout`)."""


class ValConfig(Section):
    """`[val]`: when and on what validation runs."""

    interval: int | None = Field(default=None, ge=1)
    """Score the sets every interval steps; unset: only at the end (with eval_on_end)."""

    eval_on_end: bool = True
    """Score the sets once more on the final weights, after the final checkpoint."""

    seq_lens: list[int] = Field(default_factory=list)
    """Context lengths to score at (each document cut into chunks of this many tokens); empty: data.seq_len."""

    micro_batch_tokens: int | None = Field(default=None, ge=2)
    """Tokens per scoring row; unset: data.micro_batch_tokens."""

    data_dir: str | None = None
    """Folder of eval set files, `NAME.KIND.jsonl` or `.parquet` with KIND `ppl`, `ctxcont` or `pairs` (see
    docs/validation.md); `sets` names them by NAME."""

    sets: list[ValSetConfig | str] = Field(default_factory=list)
    """What to score: `{ name = "...", path = "..." }` for a held-out token folder, or the NAME of a set file in
    data_dir."""

    save_arrays: bool = False
    """Also write each ctxcont/pairs set's per-choice log-likelihoods to `<output_dir>/val_arrays/step_<N>/`
    (`<set>@<length>.npz`), for analysis after the run."""

    data: list[str] = Field(default_factory=list)
    """SFT's held-out samples (data.type = "sft"): files or folders in the forms data.paths takes, read with the
    same loss_mask and overlong rule; scored as `val/loss` and `val/perplexity` over their loss tokens."""

    @field_validator("sets")
    @classmethod
    def _plain_set_names(cls, sets: list[ValSetConfig | str]) -> list[ValSetConfig | str]:
        # A set file's NAME also names its `val_arrays/step_<N>/<NAME>@<length>.npz`.
        for i, s in enumerate(sets):
            if isinstance(s, str):
                try:
                    check_path_name(s)
                except ValueError as err:
                    raise ValueError(f"entry {i} ({s!r}) {err}") from None
        return sets

    @field_validator("data", mode="before")
    @classmethod
    def _one_path(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class EvalSnapshotsConfig(Section):
    """`[eval_snapshots]`: model-only snapshots for `lmforge eval`, which scores the `[val]` sets elsewhere."""

    interval: int | None = Field(default=None, ge=1)
    """Write a model-only snapshot to `<output_dir>/snapshots/step_N/` every interval steps and at the last step,
    in the background; unset: none."""
