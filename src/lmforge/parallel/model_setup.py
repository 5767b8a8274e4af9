"""The run's model, built the same way for training and for the eval worker: its vocabulary size from the
tokenizer (or a pretrained folder), then built on the meta device and sharded for this rank."""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.config.loader import ConfigError
from lmforge.config.train import TrainConfig
from lmforge.data.tokenizer import TokenizerInfo
from lmforge.model import build_model
from lmforge.model.fp8 import apply_fp8, check_fp8_device
from lmforge.model.llama import CausalLM
from lmforge.model.loss import resolve_loss_chunk
from lmforge.parallel.fsdp import fsdp_wraps, parallelize, resolve_param_dtype
from lmforge.parallel.pipeline import Pipeline, build_pipeline, split_stages
from lmforge.parallel.process_group import DistContext

VOCAB_MULTIPLE = 128


def padded_vocab_size(n: int) -> int:
    """The model's vocabulary: n token ids rounded up to a multiple of 128 (faster matmuls, shardable)."""
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_vocab_size(config: TrainConfig, tokenizer: TokenizerInfo | None) -> int:
    """The model's vocabulary: a pretrained model's own, else the tokenizer's length (or fake data's id range)
    rounded up to 128."""
    if config.model.name is not None:
        from lmforge.config.hf_config import read_hf_config

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


def build_run_model(
    config: TrainConfig,
    tokenizer: TokenizerInfo | None,
    ctx: DistContext,
    target: torch.device | None = None,
    shard: bool = True,
) -> CausalLM:
    """The configured model, with FP8 linear layers, checkpointed, compiled and sharded (or moved) for this rank as
    `model` asks, with uninitialized storage: the caller fills the weights (init, checkpoint or HF folder).

    `target` is the device whose choices to make (attention kernel, loss chunking, parameter dtype), by default the
    rank's own. `lmforge plan` builds on the CPU, on fake tensors, the model a CUDA run would train; the FP8 device
    check is then the planner's (it knows the target GPU). With `shard` False the model is left unsharded on the
    meta device (`parallelize`)."""
    target = target or ctx.device
    model = _meta_model(config, tokenizer, target)
    # FSDP's float8 all-gather scales each weight over its FSDP shards only; a TP-split weight's scale would then be
    # its TP part's, not the whole tensor's. Under TP each layer casts its gathered weight instead.
    _convert_fp8(
        model, config, ctx, target, shard and fsdp_wraps(config.model, ctx, target) and config.parallel.tp == 1
    )
    parallelize(model, model.blocks, config.model, ctx, target, shard)  # in place: the sharded model is the same object
    return model


def build_pipelined_model(
    config: TrainConfig,
    tokenizer: TokenizerInfo | None,
    ctx: DistContext,
    target: torch.device | None = None,
) -> tuple[CausalLM, Pipeline]:
    """Under pipeline parallelism (`parallel.pp` > 1): the configured model with only this rank's stages in it,
    sharded over its stage group's data-parallel ranks, and the pipeline that trains it. Weights uninitialized, as
    `build_run_model` leaves them; `target` as there (`lmforge plan` builds a CUDA run's stages on fake tensors)."""
    arch = config.model.arch
    assert arch is not None, "model.arch is filled in from model.name when the config is loaded"
    target = target or ctx.device
    model = _meta_model(config, tokenizer, target)
    modules = split_stages(model, config.parallel, ctx.pp)
    # FSDP always wraps the stages; under TP each layer casts its gathered weight instead (see build_run_model)
    _convert_fp8(model, config, ctx, target, fsdp_all_gather=config.parallel.tp == 1)
    parallelize(model, model.blocks, config.model, ctx, target, roots=modules)
    data = config.data
    rows = data.batch_tokens // (data.micro_batch_tokens * ctx.dp_size)
    dtype = resolve_param_dtype(config.model.param_dtype, target)
    # Under context parallelism a stage holds its rank's 1 / cp of each row.
    pipeline = build_pipeline(modules, ctx.pp, config.parallel, rows, data.micro_batch_tokens // ctx.cp.size, dtype,
                              ctx.device, ctx.tp)  # fmt: skip
    return model, pipeline


def _meta_model(config: TrainConfig, tokenizer: TokenizerInfo | None, target: torch.device) -> CausalLM:
    """The configured model on the meta device, its attention kernel and loss chunking chosen for `target`."""
    arch = config.model.arch
    assert arch is not None, "model.arch is filled in from model.name when the config is loaded"
    vocab = model_vocab_size(config, tokenizer)
    model = build_model(arch, vocab, config.model.attn, target, meta=True, compiled=config.model.compile)
    model.loss_chunk_tokens = resolve_loss_chunk(config.model.loss_chunk_tokens, target)
    return model


def _convert_fp8(
    model: CausalLM, config: TrainConfig, ctx: DistContext, target: torch.device, fsdp_all_gather: bool
) -> None:
    """Swap in `model.fp8`'s float8 linear layers (none when it is `none`), before checkpointing, compilation and
    sharding, which wrap the converted layers."""
    if config.model.fp8 == "none":
        return
    if target == ctx.device:
        check_fp8_device(config.model.fp8, config.model.fp8_emulate, ctx.device)
    apply_fp8(model.blocks, config.model.fp8, config.model.fp8_emulate, fsdp_all_gather=fsdp_all_gather)
