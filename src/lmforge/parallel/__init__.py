"""Process groups, the device mesh, and how a model is sharded over them (FSDP2)."""

from lmforge.parallel.fsdp import apply_activation_checkpointing, parallelize, resolve_param_dtype
from lmforge.parallel.process_group import DistContext, env_world_size, init_distributed, shutdown_distributed

__all__ = [
    "DistContext",
    "apply_activation_checkpointing",
    "env_world_size",
    "init_distributed",
    "parallelize",
    "resolve_param_dtype",
    "shutdown_distributed",
]
