"""The speedrun's baseline: an independent nanoGPT-style pretraining loop on datatrove token shards.

It shares no code with lmforge: the model is `plain_loop.py`'s Llama (RMSNorm, RoPE, grouped-query attention,
SwiGLU, HF Llama parameter names), and everything else is here, in plain PyTorch and numpy, the way a nanoGPT fork
trains:

- **Data.** The `.ds` files of the training folder are read with numpy (little-endian ids, the id width from the
  `.ds.metadata` file) and joined into one stream. Each step takes `batch` windows of `seq_len + 1` tokens at
  uniformly random offsets of the stream (a numpy generator seeded with `--seed`), split into micro-batches of
  `micro_batch` windows; windows cross document boundaries, as nanoGPT's do.
- **Model and init.** Normal(0, 0.02) for every matrix and embedding, and normal(0, 0.02 / sqrt(2 x layers)) for
  the projections that write into the residual stream (`o_proj`, `down_proj`), GPT-2's scaled init. Norm scales
  start at one. The LM head is untied.
- **Optimizer.** AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices and embeddings), the global
  gradient norm clipped to 1, a learning rate that rises linearly over the first `warmup` fraction of the steps
  and then follows a half cosine down to `min_lr_ratio` x lr at the last step.
- **Held-out loss.** Every document of the held-out folder is cut into consecutive chunks of `seq_len` tokens; in
  each chunk every token after the first is predicted from those before it (the chunk starts at position 0). The
  loss is the mean fp32 cross-entropy over all those predictions: the rule lmforge's validation uses for a
  held-out token folder, computed here independently (chunks right-padded into batches; causal attention keeps the
  padding out of every scored position).

The loss is evaluated at step 0, every `eval_every` steps and at the last step, untimed. `train_s` in the curve is
the training time only: the wall time of the steps (data, forward, backward, clip, optimizer), excluding
evaluation. With `--export DIR` the final weights are written as an HF Llama folder (config.json, safetensors, the
tokenizer's files), which `lmforge eval --model DIR` scores.

    .venv/bin/python benchmarks/speedrun_baseline.py --train data/demo/train --heldout data/demo/heldout
        --tokenizer data/demo/tokenizer --steps 100 --lr 2e-3 [--seed 0] [--eval-every 10] [--json F] [--export D]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plain_loop import Llama, LlamaShape


@dataclass(frozen=True)
class BaselineSettings:
    """One baseline run: the model shape, the batch, the optimizer and schedule, the run length and evaluation."""

    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 6
    seq_len: int = 256
    batch: int = 32
    """Windows per optimizer step."""
    micro_batch: int = 8
    """Windows per forward pass (gradient accumulation over batch / micro_batch passes)."""
    steps: int = 100
    lr: float = 2e-3
    warmup: float = 0.05
    """Fraction of the steps of linear warmup."""
    min_lr_ratio: float = 0.1
    """The cosine ends at this fraction of lr."""
    weight_decay: float = 0.1
    max_norm: float = 1.0
    init_std: float = 0.02
    seed: int = 0
    eval_every: int = 10
    threads: int = 2
    compile: bool = False


# ---------------------------------------------------------------------------------------------- data


def read_token_folder(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every token of the `.ds` shards in `folder` (sorted by name) as one int64 array, and the end offset of every
    document in it."""
    tokens, ends, offset = [], [], 0
    shards = sorted(folder.glob("*.ds"))
    if not shards:
        raise SystemExit(f"speedrun_baseline.py: no .ds shards in {folder}")
    for path in shards:
        width = int(path.with_name(path.name + ".metadata").read_text().splitlines()[0].rsplit("|", 1)[1])
        ids = np.fromfile(path, dtype={2: "<u2", 4: "<u4"}[width]).astype(np.int64)
        doc_ends = np.fromfile(path.with_name(path.name + ".index"), dtype="<u8").astype(np.int64)
        tokens.append(ids)
        ends.append(doc_ends + offset)
        offset += len(ids)
    return np.concatenate(tokens), np.concatenate(ends)


def heldout_chunks(tokens: np.ndarray, doc_ends: np.ndarray, seq_len: int) -> tuple[Tensor, Tensor]:
    """The held-out chunks (see the module docstring), right-padded with 0 to [N, seq_len], and their lengths."""
    rows, lengths, start = [], [], 0
    for end in doc_ends.tolist():
        for lo in range(start, end, seq_len):
            chunk = tokens[lo : min(lo + seq_len, end)]
            if len(chunk) >= 2:
                rows.append(np.pad(chunk, (0, seq_len - len(chunk))))
                lengths.append(len(chunk))
        start = end
    return torch.from_numpy(np.stack(rows)), torch.tensor(lengths)


@torch.no_grad()
def heldout_loss(model: nn.Module, chunks: Tensor, lengths: Tensor, rows: int = 16) -> float:
    """Mean cross-entropy of every scored position of the held-out chunks, in fp32."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    positions = torch.arange(chunks.shape[1] - 1)
    for i in range(0, chunks.shape[0], rows):
        batch, n = chunks[i : i + rows], lengths[i : i + rows]
        logits = model(batch[:, :-1]).float()
        targets = torch.where(positions < (n - 1).unsqueeze(1), batch[:, 1:], -100)
        total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    model.train(was_training)
    return total / count


def random_windows(rng: np.random.Generator, tokens: np.ndarray, count: int, seq_len: int) -> Tensor:
    """`count` windows of seq_len + 1 tokens at uniformly random offsets of the stream."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=count)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]))


# ---------------------------------------------------------------------------------------------- model


def shape_of(s: BaselineSettings, vocab_size: int) -> LlamaShape:
    """The Llama of these settings."""
    return LlamaShape(
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        vocab_size=vocab_size,
        max_seq_len=s.seq_len,
    )


def init_gpt2(model: nn.Module, std: float, layers: int, seed: int) -> None:
    """GPT-2's init: normal(0, std) matrices and embeddings, std / sqrt(2 x layers) for residual-out projections."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                scaled = name.endswith(("o_proj.weight", "down_proj.weight"))
                p.normal_(0.0, std / math.sqrt(2 * layers) if scaled else std, generator=gen)


def lr_at(step: int, s: BaselineSettings) -> float:
    """The learning rate of step `step` (from 1): linear warmup, then a half cosine to min_lr_ratio x lr."""
    warmup = max(1, round(s.warmup * s.steps))
    if step <= warmup:
        return s.lr * step / warmup
    progress = (step - warmup) / max(1, s.steps - warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def export_hf(model: nn.Module, shape: LlamaShape, tokenizer: Path, folder: Path) -> None:
    """The weights as an HF `LlamaForCausalLM` folder (fp32 safetensors), with the tokenizer's files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "max_position_embeddings": shape.max_seq_len,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.norm_eps,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)


# ---------------------------------------------------------------------------------------------- the run


def train(s: BaselineSettings, train_dir: Path, heldout_dir: Path, vocab_size: int,
          export: tuple[Path, Path] | None = None) -> dict[str, Any]:  # fmt: skip
    """One run; returns its settings, parameter count, curve ([step, tokens, train_s, heldout loss] at every
    evaluation), training losses, step times and final held-out loss. `export` is (tokenizer folder, output folder)."""
    torch.set_num_threads(s.threads)
    if s.batch % s.micro_batch:
        raise SystemExit(f"speedrun_baseline.py: batch {s.batch} is not a multiple of micro_batch {s.micro_batch}")
    tokens, _ = read_token_folder(train_dir)
    chunks, lengths = heldout_chunks(*read_token_folder(heldout_dir), s.seq_len)
    shape = shape_of(s, vocab_size)
    torch.manual_seed(s.seed)
    model = Llama(shape)
    init_gpt2(model, s.init_std, s.num_layers, s.seed)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    forward = torch.compile(model) if s.compile else model
    rng = np.random.default_rng(s.seed)
    step_tokens = s.batch * s.seq_len
    curve: list[list[float]] = [[0, 0, 0.0, heldout_loss(model, chunks, lengths)]]
    losses: list[float] = []
    step_s: list[float] = []
    train_s = 0.0
    for step in range(1, s.steps + 1):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        windows = random_windows(rng, tokens, s.batch, s.seq_len)
        loss_sum = torch.zeros(())
        for mb in windows.split(s.micro_batch):
            logits = forward(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten(), reduction="sum")
            (loss / (s.batch * s.seq_len)).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, s.max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss_sum) / step_tokens)
        step_s.append(time.perf_counter() - t0)
        train_s += step_s[-1]
        if not math.isfinite(losses[-1]):
            break
        if step % s.eval_every == 0 or step == s.steps:
            curve.append([step, step * step_tokens, train_s, heldout_loss(model, chunks, lengths)])
            print(f"step {step} train {losses[-1]:.4f} heldout {curve[-1][3]:.4f} train_s {train_s:.1f}", flush=True)
    if export is not None:
        export_hf(model, shape, *export)
    return {
        "settings": asdict(s),
        "params": sum(p.numel() for p in params),
        "curve": curve,
        "train_losses": losses,
        "step_s": step_s,
        "final_heldout": curve[-1][3],
        "train_s": train_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the settings as flags, the folders, `--json` and `--export`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(BaselineSettings):
        default = getattr(BaselineSettings(), f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=f"(default {default})")
        else:
            p.add_argument(flag, type=type(default), default=default, help=f"(default {default})")
    p.add_argument("--train", type=Path, required=True, help="folder of training token shards")
    p.add_argument("--heldout", type=Path, required=True, help="folder of held-out token shards")
    p.add_argument("--tokenizer", type=Path, required=True, help="the tokenizer folder (vocabulary size, export)")
    p.add_argument("--json", type=Path, default=None, help="write the run's figures here")
    p.add_argument("--export", type=Path, default=None, help="write the final weights here as an HF Llama folder")
    return p.parse_args(argv)


def vocab_size_of(tokenizer: Path) -> int:
    """Size of the tokenizer's vocabulary, added tokens included (the model's embedding rows)."""
    spec = json.loads((tokenizer / "tokenizer.json").read_text(encoding="utf-8"))
    ids = [*spec["model"]["vocab"].values(), *(t["id"] for t in spec.get("added_tokens", []))]
    return max(ids) + 1


def main(argv: list[str] | None = None) -> int:
    """Train one run and write its figures."""
    args = parse_args(argv)
    s = BaselineSettings(**{f.name: getattr(args, f.name) for f in fields(BaselineSettings)})
    export = (args.tokenizer, args.export) if args.export is not None else None
    figures = train(s, args.train, args.heldout, vocab_size_of(args.tokenizer), export)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if math.isfinite(figures["final_heldout"]) else 1


if __name__ == "__main__":
    sys.exit(main())
