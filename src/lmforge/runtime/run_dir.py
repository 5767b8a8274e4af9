"""Run setup before the step loop: the model's vocabulary size and the run directory (resume or start over)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lmforge.config.loader import ConfigError, dump_toml
from lmforge.config.train import TrainConfig
from lmforge.data import TokenizerInfo
from lmforge.train.checkpoint import CHECKPOINTS, find_checkpoint, read_trainer_state, write_atomic

VOCAB_MULTIPLE = 128


def padded_vocab_size(n: int) -> int:
    """The model's vocabulary: n token ids rounded up to a multiple of 128 (faster matmuls, shardable)."""
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_vocab_size(config: TrainConfig, tokenizer: TokenizerInfo | None) -> int:
    """The model's vocabulary: a pretrained model's own, else the tokenizer's length (or fake data's id range)
    rounded up to 128."""
    if config.model.name is not None:
        from lmforge.model.hf_config import read_hf_config

        vocab = read_hf_config(Path(config.model.name)).vocab_size
        ids = tokenizer.size if tokenizer is not None else getattr(config.data, "vocab_size", 0)
        if ids > vocab:
            raise ConfigError(f"model.name {config.model.name} has {vocab} embeddings, fewer than the {ids} token ids")
        return vocab
    if tokenizer is not None:
        if config.data.type == "fake" and config.data.vocab_size > tokenizer.size:
            raise ConfigError(
                f"data.vocab_size ({config.data.vocab_size}) exceeds the tokenizer's {tokenizer.size} ids"
            )
        return padded_vocab_size(tokenizer.size)
    assert config.data.type == "fake", "token data requires a tokenizer (checked with the config)"
    return padded_vocab_size(config.data.vocab_size)


def _truncate_metrics(path: Path, last_step: int) -> None:
    # A resumed run rewrites the steps after its checkpoint; drop their old records so the file is one curve.
    if not path.exists():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and json.loads(line)["step"] <= last_step]  # fmt: skip
    write_atomic(path, "".join(keep))


def prepare_output_dir(config: TrainConfig, overwrite: bool) -> Path | None:
    """Create the run directory and write the resolved config; returns the checkpoint to resume from, if any.

    A used output_dir is refused unless the run resumes from its own checkpoints (its metrics after the resumed
    step are dropped) or `overwrite` starts it over (its metrics and checkpoints are deleted).
    """
    out = Path(config.output_dir)
    metrics = out / "metrics.jsonl"
    resume = config.resume
    own = resume.path is None or Path(resume.path).resolve().is_relative_to(out.resolve())
    if resume.step is not None and own and overwrite:
        raise ConfigError("--overwrite deletes this run's checkpoints: it cannot be combined with resume.step")
    ckpt = find_checkpoint(Path(resume.path or out), resume.step) if resume.step is not None else None
    if metrics.exists():
        if ckpt is not None and own:
            _truncate_metrics(metrics, read_trainer_state(ckpt)["step"])
        elif resume.step == "auto" and own:
            metrics.unlink()  # the earlier attempt never reached a checkpoint: it starts over
        elif overwrite:
            metrics.unlink()
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        else:
            raise ConfigError(
                f"output_dir {out} already holds a run ({metrics} exists); choose another --output-dir, "
                "pass --overwrite to start over, or --resume.step latest to continue it"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(config), encoding="utf-8")
    return ckpt
