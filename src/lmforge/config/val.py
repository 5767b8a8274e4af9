"""`[val]`: held-out sets scored while training."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, field_validator

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


class NamedSet(Section):
    """A `val.sets` table: what every entry has."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of the set in metric keys: `val/<name>/<metric>@<length>`; letters, digits, `_`, `.` and `-`, not `.`
    or `..`. In a table without `path`: the NAME of a set file in data_dir."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return check_path_name(value)


class ValSetConfig(NamedSet):
    """One held-out token folder."""

    path: str
    """Folder of datatrove token shards (made with the run's tokenizer, e.g. `lmforge tokenize --holdout`)."""


Convention = Literal["lmforge", "lmeval"]
"""How eval set files are tokenized and scored: lmforge's own rules, or lm-evaluation-harness's."""


class ValFileConfig(NamedSet):
    """One eval set file of `val.data_dir`, with settings of its own."""

    convention: Convention | None = None
    """How this set is tokenized and scored; unset: val.convention."""


def _set_entry_kind(value: object) -> str:
    # A table with a `path` is a token folder, any other table a set file with settings; anything else is a name.
    if isinstance(value, dict):
        return "ValSetConfig" if "path" in value else "ValFileConfig"
    if isinstance(value, ValSetConfig | ValFileConfig):
        return type(value).__name__
    return "str"


SetEntry = Annotated[
    Annotated[ValSetConfig, Tag("ValSetConfig")]
    | Annotated[ValFileConfig, Tag("ValFileConfig")]
    | Annotated[str, Tag("str")],
    Discriminator(_set_entry_kind),
]
"""One `val.sets` entry: a held-out token folder, a set file with settings of its own, or a set file's NAME."""


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

    sets: list[SetEntry] = Field(default_factory=list)
    """What to score: `{ name = "...", path = "..." }` for a held-out token folder, the NAME of a set file in
    data_dir, or `{ name = "...", convention = "..." }` for a set file with its own convention."""

    convention: Convention = "lmforge"
    """How set files are tokenized and scored: "lmforge" (EOS before every text, disjoint chunks, acc_norm per
    byte) or "lmeval" (lm-evaluation-harness's rules, so the numbers equal the harness's on the exported model; see
    docs/validation.md). Held-out token folders are always scored lmforge's way."""

    save_arrays: bool = False
    """Also write each ctxcont/pairs set's per-choice log-likelihoods to `<output_dir>/val_arrays/step_<N>/`
    (`<set>@<length>.npz`), for analysis after the run."""

    data: list[str] = Field(default_factory=list)
    """SFT's held-out samples (data.type = "sft"): files or folders in the forms data.paths takes, read with the
    same loss_mask and overlong rule; scored as `val/loss` and `val/perplexity` over their loss tokens."""

    @field_validator("sets")
    @classmethod
    def _plain_set_names(cls, sets: list[SetEntry]) -> list[SetEntry]:
        # A set file's NAME also names its `val_arrays/step_<N>/<NAME>@<length>.npz`.
        for i, s in enumerate(sets):
            if isinstance(s, str):
                try:
                    check_path_name(s)
                except ValueError as err:
                    raise ValueError(f"entry {i} ({s!r}) {err}") from None
        return sets

    def files(self) -> list[tuple[str, Convention]]:
        """The set files `sets` names, in order, each with the convention it is scored by."""
        return [
            (s, self.convention) if isinstance(s, str) else (s.name, s.convention or self.convention)
            for s in self.sets
            if not isinstance(s, ValSetConfig)
        ]

    @field_validator("data", mode="before")
    @classmethod
    def _one_path(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class EvalSnapshotsConfig(Section):
    """`[eval_snapshots]`: model-only snapshots for `lmforge eval`, which scores the `[val]` sets elsewhere."""

    interval: int | None = Field(default=None, ge=1)
    """Write a model-only snapshot to `<output_dir>/snapshots/step_N/` every interval steps and at the last step,
    in the background; unset: none."""
