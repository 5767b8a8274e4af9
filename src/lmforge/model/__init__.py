"""Model architectures (the Llama family's dense and MoE decoders), document-masked attention kernels, the
chunked loss, weight init, CompleteP scaling, parameter roles, FP8 layers and generation. Distributed kernels
(context and expert parallelism) are passed in by `lmforge.parallel`; nothing here imports it."""

from lmforge.model.build import build_model
from lmforge.model.llama import CausalLM

__all__ = ["CausalLM", "build_model"]
