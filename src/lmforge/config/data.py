"""`[data]`: what the model reads. Variants are chosen by `type`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from lmforge.config.base import Section


class BatchFields(Section):
    """Batch geometry shared by every data type. All sizes are in tokens."""

    seq_len: int = Field(gt=0)
    """Tokens per training window (the longest context the model sees)."""

    batch_tokens: int = Field(gt=0)
    """Tokens per optimizer step, over all ranks; must be a multiple of micro_batch_tokens x world size."""

    micro_batch_tokens: int = Field(gt=0)
    """Tokens per forward pass on one rank (one packed row); a multiple of seq_len."""

    seed: int = 0
    """Seed of the data order."""

    document_masking: bool = True
    """Restart attention and positions at every document boundary inside a window."""


class FakeDataConfig(BatchFields):
    """`data.type = "fake"`: random tokens with random document lengths, for smoke runs and benchmarks."""

    type: Literal["fake"] = "fake"
    """Data type: random tokens generated on the fly."""

    vocab_size: int = Field(default=512, ge=2)
    """Number of distinct token ids drawn; without a tokenizer, the model's vocabulary is this rounded up to a
    multiple of 128."""

    mean_doc_len: float = Field(default=256.0, gt=1)
    """Mean document length in tokens (lengths are geometric)."""

    pattern: Literal["uniform", "counting"] = "uniform"
    """`uniform`: independent tokens (the loss cannot fall below ln(vocab_size)); `counting`: each document counts
    up from a random token with a random stride of 1-8 (mod vocab_size), which a model learns to continue from the
    previous tokens of the same document, so the loss falls well below ln(vocab_size)."""


class TokensDataConfig(BatchFields):
    """`data.type = "tokens"`: pretraining on folders of datatrove token shards, read as one pool (docs/data.md)."""

    type: Literal["tokens"] = "tokens"
    """Data type: datatrove token shards."""

    paths: list[str] = Field(min_length=1)
    """Folders of `.ds` shards, read as one pool in this order (then file order inside each folder)."""

    max_epochs: int = Field(default=1, ge=1)
    """Passes over the pool the run may make; a run that needs more fails at startup."""


Role = Literal["system", "user", "assistant", "tool"]
"""A conversation role whose tokens `data.loss_mask` can select."""


class SFTDataConfig(BatchFields):
    """`data.type = "sft"`: chat (`messages`) or `prompt`/`completion` samples, one segment each, packed
    (docs/sft.md)."""

    type: Literal["sft"] = "sft"
    """Data type: supervised fine-tuning samples."""

    paths: list[str] = Field(min_length=1)
    """JSONL or Parquet files, folders of them, or folders written by HF datasets' `save_to_disk`, read in order."""

    loss_mask: list[Role] = Field(default_factory=lambda: ["assistant"], min_length=1)
    """Roles whose tokens count toward the loss. A plain-text prompt is a `user` turn, a plain-text completion an
    `assistant` turn; an assistant turn's header (the generation prompt) never counts."""

    overlong: Literal["truncate", "drop"] = "truncate"
    """A sample of more than seq_len + 1 tokens is cut to its first seq_len + 1 tokens (`truncate`) or left out
    (`drop`); either way it is counted in `data/overlong`."""

    max_epochs: int = Field(default=1, ge=1)
    """Passes over the samples the run may make; a run whose max_steps needs more fails at startup, naming the
    number of steps the data gives."""

    @model_validator(mode="after")
    def _one_segment_per_sample(self) -> SFTDataConfig:
        if not self.document_masking:
            raise ValueError("document_masking = false would let packed samples attend to each other; sft keeps it on")
        return self


DataConfig = Annotated[FakeDataConfig | TokensDataConfig | SFTDataConfig, Field(discriminator="type")]
"""Any data type, chosen by its `type` field."""
