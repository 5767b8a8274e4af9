"""Launchers that run torchtitan and litgpt on the CPU for `peers.py`, inside each peer's own virtual environment.

This file runs under the peer's interpreter (`benchmarks/.peers/<name>/bin/python`), which has torch and the peer
but not lmforge, so it imports only the standard library, torch and the peer. `peers.py` passes the run's settings
(model shape, batch, steps, optimizer) as JSON in the `PEER_SPEC` environment variable:

    PEER_SPEC='{...}' torchrun --nproc-per-node N benchmarks/peer_shims.py torchtitan [torchtitan flags]
    PEER_SPEC='{...}' python benchmarks/peer_shims.py litgpt
    PEER_PROFILE=OUT:START:COUNT python benchmarks/peer_shims.py run -m lmforge train @ run.toml   # any side

With `PEER_PROFILE`, every side (`run` launches lmforge and the plain loop the same way) profiles its optimizer
steps START+1 .. START+COUNT with `torch.profiler` on rank 0 and writes the table of its top operators, by time
spent in the operator itself, to OUT. The steps are counted by a hook on every `torch.optim` optimizer's step, the
one place all sides share, so no side's own code is changed.

What each peer gets from here, and why (everything else is the peer's own code and defaults):

- torchtitan 0.3.0 has no CPU path: with no accelerator it picks "cuda" as its device type, its memory monitor
  calls functions only `torch.cuda` has, and every model imports its Triton kernels for MoE expert parallelism.
  `cpu_shim`, run before torchtitan is imported, makes torch report "cpu" as the available device type, gives
  `torch.cpu` those few functions (peak memory reads the process's peak resident set) and registers a stand-in for
  the Triton kernels' module; it also bridges a torch-2.13 gap (`set_timeout`) and two gloo ones (a barrier given
  `device_ids=["cpu"]`, FSDP's `PREMUL_SUM` reduction). Its config is Python, not TOML (`--module M --config F`
  names a function that returns a `Trainer.Config`): `titan_config` builds one for the benchmark's Llama with
  torchtitan's own layer builder and inits. Flex attention, torchtitan's attention for language models, has no
  backward on the CPU, so the layers get torchtitan's SDPA module instead (causal; every row is one document).
  Its text loaders read Hugging Face datasets and need a tokenizer, so `titan_config` plugs in a loader of random
  tokens and a tokenizer that is never called.
- litgpt 0.5.13 runs on the CPU as it is; `run_litgpt` calls `litgpt.pretrain.setup` (the function behind
  `litgpt pretrain`) with a `litgpt.Config` of the same Llama and a data set of random tokens, since its
  pretraining data modules download and tokenize corpora.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SPEC_ENV = "PEER_SPEC"
"""Environment variable holding the run's settings as JSON (see `peers.PeerSpec`)."""
PROFILE_ENV = "PEER_PROFILE"
"""Environment variable asking for a profile: `OUT:START:COUNT` (see the module's docstring)."""
PROFILE_ROWS = 25
"""Operators in a profile's table."""


def spec() -> dict[str, Any]:
    """The run's settings, from `PEER_SPEC`."""
    return json.loads(os.environ[SPEC_ENV])


# ---------------------------------------------------------------------------------------------- profiling


def profile_from_env() -> None:
    """When `PEER_PROFILE` is set (rank 0 only), profile the optimizer steps it names and write their table."""
    setting = os.environ.get(PROFILE_ENV)
    if not setting or os.environ.get("RANK", "0") != "0":
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out, start, count = setting.rsplit(":", 2)
    first, last = int(start) + 1, int(start) + int(count)
    state: dict[str, Any] = {"steps": 0, "optimizer": None, "profiler": None}

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        # A trainer may hold several optimizers (one per parameter group kind); count the first one's steps.
        if state["optimizer"] is None:
            state["optimizer"] = id(optimizer)
        if id(optimizer) != state["optimizer"]:
            return
        state["steps"] += 1
        if state["steps"] == first - 1:
            state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["profiler"].__enter__()
        elif state["steps"] == last and state["profiler"] is not None:
            profiler, state["profiler"] = state["profiler"], None
            profiler.__exit__(None, None, None)
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
            Path(out).write_text(f"optimizer steps {first}..{last}\n{table}\n", encoding="utf-8")

    register_optimizer_step_post_hook(after_step)


def run_program(argv: list[str]) -> None:
    """`run -m MODULE ARGS` or `run SCRIPT ARGS`: run a Python program as `python` would, after `profile_from_env`."""
    import runpy

    profile_from_env()
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------- the CPU shim


def _peak_rss_bytes() -> int:
    """This process's peak resident set (`VmHWM`), in bytes; 0 where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_shim() -> None:
    """Let a trainer written for accelerators pick the CPU: torch reports "cpu" as the available device type,
    and `torch.cpu` gains the memory functions `torch.cuda` has (only those it lacks). Nothing changes on a
    machine with an accelerator. Must run before the trainer is imported: torchtitan reads the device type once,
    at import."""
    import torch
    import torch._utils

    if torch.accelerator.is_available():
        return
    # torchtitan: `_get_available_device_type() or "cuda"`; None (no accelerator) would make it "cuda".
    torch._utils._get_available_device_type = lambda: "cpu"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def memory_stats(device: object = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    functions: dict[str, Any] = {
        "get_device_name": lambda device=None: platform.processor() or "cpu",
        "get_device_properties": lambda device=None: SimpleNamespace(total_memory=memory, name="cpu"),
        "memory_stats": memory_stats,
        # A reset would have to clear the kernel's peak RSS, which peers.py reads at the end of the run.
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }
    for name, fn in functions.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    _barrier_without_cpu_device_ids()
    _stand_in_for_triton_kernels()


def _barrier_without_cpu_device_ids() -> None:
    """torchtitan calls `barrier(device_ids=[device_module.current_device()])`, which on the CPU is `["cpu"]`, a
    type the barrier rejects; device ids only tell NCCL which GPU to use, so the wrapper drops ids that are not
    ints (`torch.cpu.current_device` itself must keep returning "cpu": FSDP builds devices from it)."""
    import torch.distributed as dist

    barrier = dist.barrier

    def cpu_barrier(group: Any = None, async_op: bool = False, device_ids: list[Any] | None = None) -> Any:
        if device_ids is not None and not all(isinstance(i, int) for i in device_ids):
            device_ids = None
        return barrier(group=group, async_op=async_op, device_ids=device_ids)

    dist.barrier = cpu_barrier
    if not hasattr(dist, "set_timeout"):
        # torchtitan 0.3.0 targets a torch whose `set_timeout` is public; torch 2.13 has it as `_set_pg_timeout`
        # (same arguments). It sets the process groups' timeout after the first step.
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
"""torchtitan's Triton kernels for MoE expert parallelism on CUDA: every model imports them (through its MoE
token dispatcher), and they import Triton, which a CPU build of torch does not install."""


def _stand_in_for_triton_kernels() -> None:
    """Where Triton is missing, register a stand-in module for `TRITON_KERNELS` whose every name is a function
    that fails when called: a dense model never calls them. (A stand-in for Triton itself would make torch's
    compiler believe Triton is there.)"""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is not None:
        return

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # module attributes that tools probe for (`__file__`, ...)

        def kernel(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{TRITON_KERNELS}.{name} needs Triton (MoE expert parallelism on CUDA)")

        return kernel

    stand_in = types.ModuleType(TRITON_KERNELS, "stand-in: MoE expert-parallel Triton kernels, not on the CPU")
    stand_in.__getattr__ = missing  # type: ignore[method-assign]  # module-level __getattr__ (PEP 562)
    sys.modules[TRITON_KERNELS] = stand_in


# ---------------------------------------------------------------------------------------------- torchtitan


def titan_config() -> Any:
    """The torchtitan `Trainer.Config` of the run in `PEER_SPEC` (torchtitan's `--config` function).

    The model is torchtitan's Llama 3 built by its own layer builder, with the benchmark's shape, RoPE without
    Llama 3.1's frequency scaling (theta as given) and torchtitan's inits; attention is torchtitan's SDPA module
    (`is_causal=True`): its language-model default, flex attention, cannot train on the CPU. Loss, optimizer and
    parallelism are torchtitan's defaults for its Llama configs (chunked cross-entropy, AdamW over every parameter,
    FSDP2 over the ranks); the changes are fp32 parameters (its default casts them to bf16 under FSDP), no
    activation checkpointing (its default is selective), a constant learning rate, and no checkpoint or validation.
    """
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    s = spec()
    model_spec = llama3.model_registry("debugmodel")
    base = model_spec.model
    vocab, dim = s["vocab_size"], s["hidden_size"]
    head_dim = dim // s["num_heads"]
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,  # as all of torchtitan's Llama 3 flavors
        n_layers=s["num_layers"],
        dim=dim,
        n_heads=s["num_heads"],
        n_kv_heads=s["num_kv_heads"],
        hidden_dim=s["intermediate_size"],
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=s["seq_len"], theta=s["rope_theta"], scaling="none"),
        attn_backend="flex",
    )
    # Flex attention has no backward on the CPU (torch raises): use torchtitan's own SDPA module instead, the fused
    # causal kernel, which is exact here because every row is one document.
    for layer in layers:
        for _, _, parent, attr in layer.traverse(FlexAttention.Config):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    model_spec.model = dataclasses.replace(
        base,
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=dataclasses.replace(base.tok_embeddings, num_embeddings=vocab, embedding_dim=dim),
        norm=dataclasses.replace(base.norm, normalized_shape=dim),
        lm_head=dataclasses.replace(base.lm_head, in_features=dim, out_features=vocab),
        layers=layers,
    )
    loader, tokenizer = _titan_plugins()
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=s["out_dir"],
        dump_folder=s["out_dir"],
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))
        ),
        optimizer=default_adamw(
            lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"], weight_decay=s["weight_decay"]
        ),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(
            local_batch_size=s["local_batch"],
            seq_len=s["seq_len"],
            steps=s["steps"],
            max_norm=s["max_norm"],
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        tokenizer=tokenizer.Config(),
        dataloader=loader.Config(),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint=None,
    )


def _titan_plugins() -> tuple[type, type]:
    """torchtitan's extension points for data: a loader of random tokens and a tokenizer that is never called.

    Defined on first use: they subclass torchtitan's classes, which must not be imported before `cpu_shim`."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class RandomTokens(BaseDataLoader):
        """Rows of uniform random tokens, each one document, from a seed per rank. No `positions`: with them,
        torchtitan would build a document mask, which its SDPA module cannot take."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any, *, dp_rank: int, seq_len: int, local_batch_size: int, **_: Any) -> None:
            s = spec()
            self.vocab, self.rows, self.seq_len = s["vocab_size"], local_batch_size, seq_len
            self.gen = torch.Generator().manual_seed(s["seed"] * 1000 + dp_rank)

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                tokens = torch.randint(0, self.vocab, (self.rows, self.seq_len + 1), generator=self.gen)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    class NoTokenizer(BaseTokenizer):
        """Stands in for the Hugging Face tokenizer torchtitan loads: random tokens need none."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any = None, *, tokenizer_path: str = "") -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("the benchmark feeds token ids")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("the benchmark feeds token ids")

        def get_vocab_size(self) -> int:
            return int(spec()["vocab_size"])

    return RandomTokens, NoTokenizer


def _sum_reduction_on_gloo() -> None:
    """torchtitan scales the loss by the step's global token count itself and sets FSDP's gradient divide factor
    to 1, for which FSDP reduce-scatters with `PREMUL_SUM(1.0)`, an op gloo lacks. On the CPU, also ask FSDP for a
    plain SUM: the same reduction (a factor of 1)."""
    import torch

    if torch.accelerator.is_available():
        return
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    divide_by_one = fsdp.disable_fsdp_gradient_division

    def divide_by_one_with_sum(model: torch.nn.Module) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = divide_by_one_with_sum


def run_torchtitan(argv: list[str]) -> None:
    """torchtitan's training entry point (`torchtitan.train.main`) with `argv` as its flags, after the CPU shim.
    Without `--module`/`--config`, the run's config is `titan_config` of this file."""
    cpu_shim()
    _sum_reduction_on_gloo()
    if "--module" not in argv:
        # torchtitan imports the module by name; the folder of this file is on sys.path when it runs as a script.
        argv = ["--module", "peer_shims", "--config", "titan_config", *argv]
    sys.argv = [sys.argv[0], *argv]
    from torchtitan.train import main

    main()


# ---------------------------------------------------------------------------------------------- litgpt


class RandomRows:
    """A map-style data set of rows of seq_len + 1 uniform random tokens (pretrain cuts inputs and targets from
    them), row i drawn from its own seed. At module level and holding only numbers, so that litgpt can pickle it
    into its checkpoint with the data loader."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __len__(self) -> int:
        return 2**40  # endless in practice: the run stops at its token budget

    def __getitem__(self, index: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)


def run_litgpt() -> None:
    """`litgpt.pretrain.setup` for the run in `PEER_SPEC`: the same Llama as a `litgpt.Config`, random tokens,
    fp32, AdamW at a constant learning rate, one micro-batch per step, no validation or checkpoint between steps
    (litgpt still writes its final checkpoint after the last step). litgpt compiles the model itself."""
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.data import DataModule
    from litgpt.pretrain import setup
    from torch.utils.data import DataLoader

    s = spec()
    devices = s["procs"]

    @dataclasses.dataclass
    class RandomData(DataModule):
        """A litgpt data module of random tokens."""

        batch_size: int = 1

        def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
            self.batch_size = batch_size

        def train_dataloader(self) -> DataLoader:
            return DataLoader(RandomRows(s["vocab_size"], s["seq_len"], s["seed"]), batch_size=self.batch_size)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(RandomRows(s["vocab_size"], s["seq_len"], s["seed"] + 1), batch_size=self.batch_size)

    config = Config(
        name="lmforge-peers-llama",
        block_size=s["seq_len"],
        vocab_size=s["vocab_size"],
        padded_vocab_size=s["vocab_size"],
        n_layer=s["num_layers"],
        n_head=s["num_heads"],
        n_query_groups=s["num_kv_heads"],
        n_embd=s["hidden_size"],
        head_size=s["hidden_size"] // s["num_heads"],
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=s["norm_eps"],
        mlp_class_name="LLaMAMLP",
        intermediate_size=s["intermediate_size"],
        rope_base=int(s["rope_theta"]),
    )
    batch = s["local_batch"] * devices
    train = TrainArgs(
        save_interval=None,
        log_interval=1,
        global_batch_size=batch,
        micro_batch_size=s["local_batch"],
        max_tokens=s["steps"] * batch * s["seq_len"],
        max_norm=s["max_norm"],
        min_lr=s["lr"],  # cosine decay from lr to lr: a constant learning rate
        lr_warmup_steps=0,
        tie_embeddings=False,
    )
    optimizer = {
        "class_path": "torch.optim.AdamW",
        "init_args": {
            "lr": s["lr"],
            "betas": (s["beta1"], s["beta2"]),
            "eps": s["eps"],
            "weight_decay": s["weight_decay"],
        },
    }
    # With its final checkpoint litgpt saves its hyperparameters by parsing the command line as `litgpt pretrain`'s
    # arguments; give it the one it requires, the model name, as `litgpt pretrain <name>` would have.
    sys.argv = [sys.argv[0], config.name]
    setup(
        model_name=config.name,
        model_config=config,
        out_dir=Path(s["out_dir"]),
        precision="32-true",
        data=RandomData(),
        train=train,
        eval=EvalArgs(interval=10**9, max_iters=1, initial_validation=False, final_validation=False),
        optimizer=optimizer,
        devices=devices,
        logger_name="csv",
        seed=s["seed"],
    )


def main(argv: list[str]) -> int:
    """`peer_shims.py torchtitan [torchtitan flags]`, `peer_shims.py litgpt` (no flags: all in `PEER_SPEC`) or
    `peer_shims.py run (-m MODULE | SCRIPT) [ARGS]`."""
    if argv[:1] == ["torchtitan"]:
        profile_from_env()
        run_torchtitan(argv[1:])
    elif argv == ["litgpt"]:
        profile_from_env()
        run_litgpt()
    elif argv[:1] == ["run"] and argv[1:]:
        run_program(argv[1:])
    else:
        print("usage: peer_shims.py torchtitan [torchtitan flags] | litgpt | run (-m MODULE | SCRIPT) [ARGS]",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
