"""Shared test helpers: tiny architectures, CPU-thread pinning, skipping `gpu` tests without CUDA, and optional
test dependencies that CI requires."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import tomli_w
import torch

from lmforge.config.arch import AnyArch, LlamaArch, Qwen3Arch

LONG = os.environ.get("LMFORGE_LONG") == "1"
"""Long mode: run the `long`-marked cases too (CI leaves them out for time; each has a shorter sibling in CI)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests on machines without CUDA, and `long`-marked ones outside long mode."""
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_long = pytest.mark.skip(reason="long mode: set LMFORGE_LONG=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "long" in item.keywords and not LONG:
            item.add_marker(skip_long)


def require(module: str) -> ModuleType:
    """Import a dev dependency a test needs (transformers, wandb, lm_eval, torchao). Outside CI a missing or broken
    one skips the test; under CI (`CI=true`), where `.[dev]` installs every one, the import error fails it instead,
    so a dependency that stopped importing (a torchao built for another torch) cannot turn tests into skips."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, exc_type=ImportError)


def tiny_llama(**overrides: object) -> LlamaArch:
    """A 2-layer Llama small enough to train in a test."""
    fields: dict[str, object] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    fields.update(overrides)
    return LlamaArch(**fields)


def arch_toml(arch: AnyArch) -> str:
    """`arch` as the `[model.arch]` section of a run config (its model_type and the fields it sets), so a TOML
    config and a Python test build the same tiny model from one definition."""
    fields = {"model_type": arch.model_type, **arch.model_dump(exclude_defaults=True)}
    return tomli_w.dumps({"model": {"arch": fields}})


def tiny_qwen3(**overrides: object) -> Qwen3Arch:
    """A 2-layer Qwen3 (QK-norm) small enough to train in a test."""
    return Qwen3Arch(**{**tiny_llama().model_dump(exclude={"model_type", "rope_theta", "rms_norm_eps"}), **overrides})


@pytest.fixture
def one_thread() -> object:
    """Pin torch to one thread so results do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
