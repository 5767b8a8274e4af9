"""The settings of the learning-rate transfer benchmark (`lr_transfer.py`) and the lmforge config of one run.

A run is told apart from the others by its `RunKey` (optimizer, init scheme, width, lr exponent); everything else
comes from `Settings` and is the same for every run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import common
from lmforge.config import TrainConfig

SCHEMES = ("normal", "completep")
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class Settings:
    """Model shapes, data geometry, schedule, grids and the evaluation protocol shared by every run."""

    widths: tuple[int, ...] = (64, 128, 256)
    base_width: int = 64
    num_layers: int = 4
    base_layers: int = 4
    head_dim: int = 32
    seq_len: int = 256
    batch_tokens: int = 4096
    micro_batch_tokens: int = 1024
    steps: int = 100
    warmup: float = 0.1
    decay: float = 0.2
    init_std: float = 0.02
    weight_decay: float = 0.1
    seed: int = 0
    attn: str = "sdpa_loop"
    lr_exps: tuple[int, ...] = (-9, -8, -7, -6)
    """AdamW learning rates of the LR-transfer grid, as base-2 exponents."""
    muon_width: int = 128
    muon_lr_exps: tuple[int, ...] = (-8, -7, -6, -5)
    """Muon learning rates, as base-2 exponents."""
    max_extend: int = 2
    """Grid steps that may be added on a side where the best lr sits at the edge of the lrs tried."""
    eval_tokens: int = 16384
    eval_every: int = 5
    """Steps between held-out evaluations of the Muon-vs-AdamW runs (the others are evaluated at the end)."""
    target_margin: float = 0.02
    threads: int = 2

    def intermediate(self, width: int) -> int:
        """SwiGLU intermediate size: 8/3 x width, rounded to a multiple of 32."""
        return max(32, round(8 * width / 3 / 32) * 32)

    def model(self, width: int) -> common.ModelSettings:
        """The Llama of one width: `num_layers` deep, heads of `head_dim`, the shared init std and seed."""
        return common.ModelSettings(
            hidden_size=width,
            intermediate_size=self.intermediate(width),
            num_hidden_layers=self.num_layers,
            num_attention_heads=width // self.head_dim,
            seq_len=self.seq_len,
            init_std=self.init_std,
            init_seed=self.seed,
        )

    def train_config(self, run: RunKey, data_dir: Path, output_dir: str) -> TrainConfig:
        """The lmforge config of one run: the demo's tokenizer and training shards, the warmup-stable-decay
        schedule, no checkpoint."""
        # CompleteP scales per role relative to the base shape; the standard scheme ignores the base fields.
        init = {"scheme": run.scheme, "base_hidden_size": self.base_width, "base_num_layers": self.base_layers}
        return TrainConfig.model_validate(
            {
                "max_steps": self.steps,
                "output_dir": output_dir,
                "tokenizer": {"name": str(data_dir / "tokenizer")},
                "model": self.model(run.width).model_section(init=init, attn=self.attn, param_dtype="float32"),
                "data": {
                    "type": "tokens",
                    "paths": [str(data_dir / "train")],
                    "seq_len": self.seq_len,
                    "batch_tokens": self.batch_tokens,
                    "micro_batch_tokens": self.micro_batch_tokens,
                    "document_masking": True,
                    "seed": self.seed,
                    # The demo corpus is small: a run may pass over it many times.
                    "max_epochs": 1000,
                },
                "optim": {"type": run.optimizer, "lr": 2.0**run.lr_exp, "weight_decay": self.weight_decay},
                "schedule": {"warmup": self.warmup, "decay": self.decay},
                "ckpt": {"final": False},
            }
        )


SMOKE = Settings(
    widths=(32, 64),
    base_width=32,
    num_layers=2,
    base_layers=2,
    seq_len=128,
    batch_tokens=512,
    micro_batch_tokens=256,
    steps=4,
    lr_exps=(-8, -7),
    muon_width=32,
    muon_lr_exps=(-8, -7),
    max_extend=0,
    eval_tokens=1024,
    eval_every=2,
)
"""Tiny widths, 2 lrs and 4 steps: checks the whole script runs, in seconds."""


@dataclass(frozen=True, order=True)
class RunKey:
    """What tells one training run from another."""

    optimizer: str
    scheme: str
    width: int
    lr_exp: int
