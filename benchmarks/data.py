"""Throughput of lmforge's token-shard loader against a raw sequential memmap copy of the same bytes, on the CPU.

The script writes its own pool of token shards in datatrove's layout (docs/data.md): per shard `NAME`, `NAME.ds`
holds the tokens as raw little-endian integers (uint16 when the vocabulary has at most 65,536 entries, else
uint32), `NAME.ds.index` the uint64 end offset of every document, and `NAME.ds.metadata` the line
`tokenizer|token_size` and then the token count. The pool is `--folders` folders of `--files` uint16 `.ds` files
each, `--tokens` tokens in all (default 200M: 8 files of 25M), documents of lognormal length (mean
`--mean-doc-len`, default 600) of random ids 1..65535, each ending with EOS (id 0), and a word-level tokenizer
folder whose 65,536 ids cover them. The pool goes to a temporary folder, or under `--pool-dir` where a later run
finds and reuses it.

Every shard file is read once before anything is timed, so both sides read from the page cache (the pool must fit
in free memory); the table says how long that warming pass took.

- `loader`: `lmforge.data.tokens.TokenData` (rank 0 of `--world-size`, default 1) with seq_len 2048, document
  masking, the default random window order, 64 x 2048 tokens per step in micro-batches of 4 x 2048. Each timed
  call is `next_step()`, which builds the step's micro-batches (int64 `input_ids`, `target_ids`, `position_ids`,
  bool `loss_mask`, int32 `seq_lens` tensors). tokens/s counts the `input_ids` tokens of the micro-batches
  produced per second. Steps run until `--read-tokens` tokens (default 100M) or `--max-seconds` (default 120).
- `raw uint16`: every file copied sequentially from its `numpy.memmap` in slices of 1M tokens (`np.array(copy)`),
  in whole passes until it has copied as many tokens as the loader read and run for `--raw-seconds` (default 1):
  the cost of touching the bytes. (Slices of 4M tokens would make the int64 copies 32 MiB, past glibc's largest
  mmap threshold: every slice would then be fresh memory, page-faulted in, and the figure 4x lower.)
- `raw int64`: the same, each slice converted with `.astype(np.int64)` (what the loader hands over is int64).
- `raw windows`: the loader's access pattern without its bookkeeping: windows of seq_len + 1 tokens at stride
  seq_len inside each file, in a random order, copied 4 per micro-batch into an int64 buffer.

Target: loader >= 10M tokens/s per rank. The loader runs in lmforge's data worker thread, so a rank needs it to
keep ahead of the model, with room to spare on a GPU.

Before the timed parts the script waits (`--quiet-wait` seconds at most) for the CPUs to go idle, and it reports
the cores other processes used during the loader's timed steps.

    .venv/bin/python benchmarks/data.py [--tokens N] [--folders N] [--files N] [--mean-doc-len N] [--pool-dir DIR]
                                        [--read-tokens N] [--max-seconds S] [--warmup N] [--raw-seconds S]
                                        [--world-size N] [--quiet-wait S] [--profile] [--json PATH]
    .venv/bin/python benchmarks/data.py --smoke        # 2M-token pool, 4 steps (a few seconds)

The script always exits 0 when both sides ran (it is a benchmark, not a test); PASS/MISS marks the target.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

import common
from cpu_load import ForeignLoad, settle
from lmforge.config.data import TokensDataConfig
from lmforge.data.batch import MicroBatch
from lmforge.data.tokenizer import load_tokenizer
from lmforge.data.tokens import TokenData

TARGET_TOKENS_PER_S = 10_000_000
"""Loader tokens/s per rank the target asks for."""
EOS_ID = 0
"""The tokenizer's EOS id: ends every document of the pool."""
VOCAB_SIZE = 65536
"""Ids 0..65535: every uint16 value (EOS 0, words 1..65535)."""
RAW_SLICE = 1024 * 1024
"""Tokens per slice of the raw sequential copies."""
FOREIGN_LIMIT = 0.1
"""Cores of foreign load above which the loader's figure is flagged as unreliable."""
MIN_FOREIGN_S = 1.0
"""Timed loader seconds below which the foreign load is not reported (too few clock ticks to tell)."""


@dataclass(frozen=True)
class Settings:
    """The pool and the loader's geometry."""

    tokens: int = 200_000_000
    """Tokens in the pool."""
    folders: int = 4
    """Folders of the pool (data.paths)."""
    files: int = 2
    """`.ds` files per folder."""
    mean_doc_len: float = 600.0
    """Mean document length in tokens (EOS included)."""
    doc_len_sigma: float = 1.0
    """Sigma of the lognormal document lengths (of their log)."""
    pool_seed: int = 0
    """Seed of the pool's contents."""
    seq_len: int = 2048
    batch_tokens: int = 64 * 2048
    micro_batch_tokens: int = 4 * 2048
    world_size: int = 1
    """The loader is rank 0 of this many ranks: it builds batch_tokens / world_size tokens per step."""
    warmup: int = 2
    """Untimed loader steps first."""
    read_tokens: int = 100_000_000
    """Timed loader steps run until they have produced this many tokens (or max_seconds passed)."""
    max_seconds: float = 120.0
    """Wall budget of the timed loader steps (at least one step runs)."""
    raw_seconds: float = 1.0
    """Each raw side runs at least this long (and copies at least as many tokens as the loader produced)."""

    @property
    def rank_tokens(self) -> int:
        """Input tokens rank 0 gets per step."""
        return self.batch_tokens // self.world_size

    @property
    def steps(self) -> int:
        """Timed loader steps planned (fewer if max_seconds runs out)."""
        return max(1, math.ceil(self.read_tokens / self.rank_tokens))


SMOKE = Settings(
    tokens=2_000_000, folders=2, files=2, warmup=1, read_tokens=4 * 64 * 2048, max_seconds=30.0, raw_seconds=0.0
)
"""A pool of 2M tokens and 4 timed steps: checks the script runs, in a few seconds."""


# ---------------------------------------------------------------------------------------------- the pool


def doc_ends(rng: np.random.Generator, n_tokens: int, mean: float, sigma: float) -> np.ndarray:
    """uint64 END offsets of lognormal-length documents (>= 1 token, mean `mean`) that fill `n_tokens` exactly."""
    mu = math.log(mean) - sigma**2 / 2
    ends = np.empty(0, dtype=np.int64)
    while ends.size == 0 or ends[-1] < n_tokens:
        lengths = np.maximum(rng.lognormal(mu, sigma, size=int(n_tokens / mean * 1.1) + 16).astype(np.int64), 1)
        ends = np.concatenate([ends, (ends[-1] if ends.size else 0) + np.cumsum(lengths)])
    ends = ends[: int(np.searchsorted(ends, n_tokens)) + 1]
    ends[-1] = n_tokens  # the last document is cut to fill the file
    return ends.astype(np.uint64)


def write_file(path: Path, n_tokens: int, rng: np.random.Generator, settings: Settings) -> int:
    """One `.ds` file (+ .index, .metadata) of `n_tokens` uint16 tokens, written in chunks; returns its documents."""
    ends = doc_ends(rng, n_tokens, settings.mean_doc_len, settings.doc_len_sigma)
    eos_at = ends.astype(np.int64) - 1
    chunk = 8 * 1024 * 1024
    with open(path, "wb") as f:
        for lo in range(0, n_tokens, chunk):
            hi = min(lo + chunk, n_tokens)
            ids = np.frombuffer(rng.bytes(2 * (hi - lo)), dtype="<u2").copy()
            np.maximum(ids, 1, out=ids)  # words are 1..65535: EOS appears only where a document ends
            k0, k1 = np.searchsorted(eos_at, [lo, hi])
            ids[eos_at[k0:k1] - lo] = EOS_ID
            f.write(ids.tobytes())
    common.write_shard_index(path, ends, "benchmark-word-tokenizer")
    return int(ends.size)


@dataclass
class Pool:
    """A pool written (or found) on disk."""

    root: Path
    folders: list[Path]
    tokenizer: Path
    files: list[Path]
    docs: int
    write_s: float
    reused: bool


def pool_name(settings: Settings) -> str:
    """Folder name of a pool under --pool-dir: a pool is reused only when everything that shapes it matches."""
    s = settings
    shape = f"{s.tokens}-{s.folders}x{s.files}-doc{s.mean_doc_len:g}s{s.doc_len_sigma:g}"
    return f"pool-{shape}-seed{s.pool_seed}-v{VOCAB_SIZE}"


def make_pool(parent: Path, settings: Settings) -> Pool:
    """Write the pool under `parent` (or reuse the one a previous run finished there)."""
    root = parent / pool_name(settings)
    folders = [root / f"folder{i}" for i in range(settings.folders)]
    marker = root / "pool.json"
    if marker.is_file():
        info = json.loads(marker.read_text(encoding="utf-8"))
        files = [Path(p) for p in info["files"]]
        return Pool(root, folders, root / "tokenizer", files, int(info["docs"]), float(info["write_s"]), True)
    if root.exists():
        shutil.rmtree(root)  # an unfinished pool of an interrupted run
    t0 = time.perf_counter()
    tokenizer = common.write_word_tokenizer(root / "tokenizer", VOCAB_SIZE)
    n_files = settings.folders * settings.files
    sizes = [settings.tokens // n_files + (1 if i < settings.tokens % n_files else 0) for i in range(n_files)]
    rng = np.random.default_rng(settings.pool_seed)
    files, docs = [], 0
    for i, size in enumerate(sizes):
        folder = folders[i // settings.files]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i % settings.files:05d}_input_ids.ds"
        docs += write_file(path, size, rng, settings)
        files.append(path)
    write_s = time.perf_counter() - t0
    info = {"files": [str(p) for p in files], "docs": docs, "write_s": write_s, "settings": asdict(settings)}
    marker.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return Pool(root, folders, tokenizer, files, docs, write_s, False)


def warm_page_cache(files: list[Path]) -> tuple[float, int]:
    """Read every shard file (tokens, index) once so the timed parts read from the page cache; (seconds, bytes)."""
    buf = bytearray(16 * 1024 * 1024)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for path in files:
        for p in (path, path.with_name(path.name + ".index")):
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return time.perf_counter() - t0, total


# ---------------------------------------------------------------------------------------------- the two sides


def make_loader(pool: Pool, settings: Settings) -> TokenData:
    """rank 0's TokenData over the pool, allowed enough epochs for warmup + the planned steps."""
    needed = (settings.warmup + settings.steps) * settings.batch_tokens / settings.tokens
    cfg = TokensDataConfig(
        paths=[str(f) for f in pool.folders],
        seq_len=settings.seq_len,
        batch_tokens=settings.batch_tokens,
        micro_batch_tokens=settings.micro_batch_tokens,
        document_masking=True,
        max_epochs=math.ceil(needed) + 1,
    )
    return TokenData(cfg, rank=0, world_size=settings.world_size, tokenizer=load_tokenizer(pool.tokenizer))


def check_boundaries(micro_batches: list[MicroBatch], seq_len: int) -> bool:
    """Segments follow documents: inside each window, the inputs hold EOS exactly at the last position of every
    segment but the window's last (the pool has EOS only where a document ends), and positions restart at 0."""
    for mb in micro_batches:
        ids = mb.input_ids[0].numpy()
        lens = mb.doc_lens.numpy().astype(np.int64)
        ends = np.cumsum(lens)
        if ends[-1] != ids.size or not np.array_equal(mb.position_ids[0].numpy()[ends - lens], np.zeros_like(lens)):
            return False
        if not bool(mb.loss_mask.all()):
            return False
        for w in range(ids.size // seq_len):
            lo, hi = w * seq_len, (w + 1) * seq_len
            inner = ends[(ends > lo) & (ends < hi)] - 1 - lo  # last input position of each non-final segment
            eos = np.flatnonzero(ids[lo : hi - 1] == EOS_ID)
            if not np.array_equal(inner, eos):
                return False
    return True


def run_loader(pool: Pool, settings: Settings, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """Time `next_step()` over the planned steps (or max_seconds); figures of the timed steps."""
    t0 = time.perf_counter()
    data = make_loader(pool, settings)
    open_s = time.perf_counter() - t0
    boundaries_ok = True
    for _ in range(settings.warmup):
        boundaries_ok &= check_boundaries(data.next_step(), settings.seq_len)
    seconds: list[float] = []
    tokens = micro_batches = segments = 0
    load = ForeignLoad()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    deadline = time.perf_counter() + settings.max_seconds
    if profile is not None:
        profile.enable()
    for _ in range(settings.steps):
        t = time.perf_counter()
        step = data.next_step()
        seconds.append(time.perf_counter() - t)
        tokens += sum(mb.input_ids.numel() for mb in step)
        micro_batches += len(step)
        segments += sum(mb.doc_lens.numel() for mb in step)
        if time.perf_counter() > deadline:
            break
    if profile is not None:
        profile.disable()
    total = sum(seconds)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {
        "open_s": open_s,
        "steps": len(seconds),
        "tokens": tokens,
        "micro_batches": micro_batches,
        "seconds": total,
        "tokens_per_s": tokens / total,
        "step_s_median": sorted(seconds)[len(seconds) // 2],
        "segments_per_window": segments / (tokens / settings.seq_len),
        "page_faults_per_window": faults / (tokens / settings.seq_len),
        "epoch_reached": data.epoch,
        "boundaries_ok": boundaries_ok,
        # /proc/stat counts in clock ticks (10 ms): over a short run the figure would be noise.
        "foreign_cores": load.cores(max(total, 1e-9)) if total >= MIN_FOREIGN_S else None,
    }


def run_raw(files: list[Path], min_tokens: int, min_seconds: float, int64: bool) -> dict[str, Any]:
    """Sequential copies of every file in RAW_SLICE slices, in whole passes until `min_tokens` tokens were copied
    and `min_seconds` passed."""
    maps = [np.memmap(p, dtype="<u2", mode="r") for p in files]
    tokens = passes = 0
    checksum = 0
    t0 = time.perf_counter()
    while tokens < min_tokens or passes == 0 or time.perf_counter() - t0 < min_seconds:
        for mm in maps:
            for lo in range(0, mm.shape[0], RAW_SLICE):
                out = mm[lo : lo + RAW_SLICE].astype(np.int64) if int64 else np.array(mm[lo : lo + RAW_SLICE])
                checksum ^= int(out[-1])  # keep the copy alive and used
                tokens += out.shape[0]
        passes += 1
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "passes": passes, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run_raw_windows(files: list[Path], settings: Settings, min_tokens: int, min_seconds: float) -> dict[str, Any]:
    """The loader's access pattern, bare: per-file windows (seq_len + 1 tokens, stride seq_len) in a random order,
    copied micro_batch_tokens / seq_len at a time into an int64 buffer of (windows, seq_len + 1)."""
    maps = [np.memmap(p, dtype="<u2", mode="r") for p in files]
    s = settings.seq_len
    per_file = [(mm.shape[0] - 1) // s for mm in maps]
    owner = np.repeat(np.arange(len(maps)), per_file)
    local = np.concatenate([np.arange(n) for n in per_file])
    order = np.random.default_rng(0).permutation(owner.size)
    k = settings.micro_batch_tokens // s
    buf = np.empty((k, s + 1), dtype=np.int64)
    tokens = 0
    t0 = time.perf_counter()
    i = 0
    while tokens < min_tokens or time.perf_counter() - t0 < min_seconds:
        for j in range(k):
            w = order[(i + j) % order.size]
            start = int(local[w]) * s
            buf[j] = maps[owner[w]][start : start + s + 1]
        i += k
        tokens += k * s
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def profile_report(profile: cProfile.Profile, lines: int = 25) -> str:
    """The profile's top functions by own time."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- report


def print_report(summary: dict[str, Any], console: Console) -> None:
    """The table: loader and raw tokens/s, the ratios, and the target verdict."""
    s = Settings(**summary["settings"])
    pool, loader, raw = summary["pool"], summary["loader"], summary["raw"]
    title = (
        f"token-shard loader vs raw memmap copy: pool {pool['tokens'] / 1e6:,.0f}M uint16 tokens in "
        f"{len(pool['files'])} files, {pool['docs']:,} documents (mean {s.mean_doc_len:g} tokens); seq "
        f"{s.seq_len}, {s.rank_tokens} tokens/step/rank in {s.rank_tokens // s.micro_batch_tokens} "
        f"micro-batches, rank 0 of {s.world_size}; from the page cache"
    )
    table = common.result_table(title, ("side", "tokens read", "seconds", "tokens/s", "loader / side"))
    table.add_row(
        f"loader: TokenData.next_step ({loader['steps']} steps)",
        f"{loader['tokens']:,}",
        f"{loader['seconds']:.2f}",
        f"{loader['tokens_per_s']:,.0f}",
        "",
    )
    labels = {
        "uint16": "raw: sequential memmap copy, uint16",
        "int64": "raw: sequential memmap copy + astype(int64)",
        "windows": "raw: same-size windows, random order, int64",
    }
    for key, label in labels.items():
        r = raw[key]
        table.add_row(
            label,
            f"{r['tokens']:,}",
            f"{r['seconds']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{loader['tokens_per_s'] / r['tokens_per_s']:.3f}x",
        )
    table.add_section()
    target = f">= {TARGET_TOKENS_PER_S:,}"
    table.add_row(
        "target: loader tokens/s per rank", "", "", target, common.verdict(summary["target_pass"]), style="bold"
    )
    console.print(table)
    reused = "reused from a previous run" if pool["reused"] else f"written in {pool['write_s']:.1f} s"
    console.print(
        f"pool: {pool['root']} ({reused}); page cache warmed first: {summary['warm']['bytes'] / 2**20:,.0f} MiB read "
        f"in {summary['warm']['seconds']:.2f} s ({summary['warm']['bytes'] / 2**30 / summary['warm']['seconds']:.1f} "
        f"GiB/s)",
        highlight=False,
    )
    console.print(
        f"loader: opened in {loader['open_s']:.2f} s; median step {loader['step_s_median'] * 1e3:.1f} ms; "
        f"per window {loader['segments_per_window']:.2f} documents (segments) and "
        f"{loader['page_faults_per_window']:.2f} minor page faults; reached epoch {loader['epoch_reached']:.2f}; "
        "segment boundaries checked on the warmup steps: "
        f"{'ok' if loader['boundaries_ok'] else 'WRONG'}",
        highlight=False,
    )
    if loader["foreign_cores"] is not None and loader["foreign_cores"] > FOREIGN_LIMIT:
        console.print(
            f"[yellow]other processes kept {loader['foreign_cores']:.2f} cores busy during the loader's timed steps: "
            "its figure may be low; rerun on an idle machine[/]"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    presets = {"default": Settings(), "smoke": SMOKE}
    smoke = "2M-token pool and 4 steps: checks the script runs"
    p = common.benchmark_parser(__doc__, presets, smoke, quiet_wait="before the timed parts")
    p.add_argument("--tokens", type=int, default=None, help="tokens in the pool (default 200M; smoke 2M)")
    p.add_argument("--folders", type=int, default=None, help="folders of the pool (default 4; smoke 2)")
    p.add_argument("--files", type=int, default=None, help=".ds files per folder (default 2)")
    p.add_argument(
        "--mean-doc-len", type=float, default=None, help="mean document length in tokens, lognormal (default 600)"
    )
    p.add_argument("--read-tokens", type=int, default=None, help="loader tokens to time (default 100M; smoke 4 steps)")
    p.add_argument("--max-seconds", type=float, default=None, help="wall budget of the loader's timed steps (120)")
    p.add_argument(
        "--raw-seconds", type=float, default=None, help="each raw side runs at least this long (default 1; smoke 0)"
    )
    p.add_argument("--world-size", type=int, default=1, help="the loader is rank 0 of this many ranks (default 1)")
    p.add_argument("--pool-dir", type=Path, default=None, help="write (or reuse) the pool under this folder")
    p.add_argument("--profile", action="store_true", help="profile the loader's timed steps (cProfile) and print it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write/reuse the pool, warm the page cache, time both sides, print the table, optionally write the JSON."""
    args = parse_args(argv)
    base = SMOKE if args.smoke else Settings()
    overrides = {
        "tokens": args.tokens,
        "folders": args.folders,
        "files": args.files,
        "mean_doc_len": args.mean_doc_len,
        "read_tokens": args.read_tokens,
        "max_seconds": args.max_seconds,
        "raw_seconds": args.raw_seconds,
    }
    settings = replace(base, world_size=args.world_size, **{k: v for k, v in overrides.items() if v is not None})
    settings = common.with_flags(settings, args)
    quiet_wait = common.quiet_wait_s(args)
    if settings.batch_tokens % (settings.micro_batch_tokens * settings.world_size):
        print("data.py: --world-size must divide the 16 micro-batches of a step", file=sys.stderr)
        return 2
    if settings.tokens < settings.folders * settings.files * (settings.seq_len + 1) or settings.warmup < 0:
        print("data.py: --tokens must give every file at least one window; --warmup must be >= 0", file=sys.stderr)
        return 2
    console = common.make_console()
    with tempfile.TemporaryDirectory(prefix="lmforge-data-bench-") as tmp:
        parent = args.pool_dir if args.pool_dir is not None else Path(tmp)
        pool = make_pool(parent, settings)
        total_tokens = sum(np.memmap(p, dtype="<u2", mode="r").shape[0] for p in pool.files)
        console.print(
            f"pool {pool.root}: {total_tokens:,} tokens, {pool.docs:,} documents in {len(pool.files)} files "
            + ("(reused)" if pool.reused else f"(written in {pool.write_s:.1f} s)"),
            highlight=False,
        )
        warm_s, warm_bytes = warm_page_cache(pool.files)
        busy = settle(quiet_wait)
        if busy is not None:
            console.print(f"CPUs before timing: {busy:.2f} cores busy", highlight=False)
        profile = cProfile.Profile() if args.profile else None
        loader = run_loader(pool, settings, profile)
        foreign = loader["foreign_cores"]
        console.print(
            f"loader: {loader['tokens']:,} tokens in {loader['seconds']:.2f} s = {loader['tokens_per_s']:,.0f} "
            "tokens/s, other processes " + (f"{foreign:.2f} cores" if foreign is not None else "not measured (< 1 s)"),
            highlight=False,
        )
        raw = {
            "uint16": run_raw(pool.files, loader["tokens"], settings.raw_seconds, int64=False),
            "int64": run_raw(pool.files, loader["tokens"], settings.raw_seconds, int64=True),
            "windows": run_raw_windows(pool.files, settings, loader["tokens"], settings.raw_seconds),
        }
    summary = {
        "settings": asdict(settings),
        "pool": {
            "root": str(pool.root),
            "files": [str(p) for p in pool.files],
            "tokens": total_tokens,
            "docs": pool.docs,
            "write_s": pool.write_s,
            "reused": pool.reused,
        },
        "warm": {"seconds": warm_s, "bytes": warm_bytes},
        "loader": loader,
        "raw": raw,
        "ratio_to_raw_uint16": loader["tokens_per_s"] / raw["uint16"]["tokens_per_s"],
        "ratio_to_raw_int64": loader["tokens_per_s"] / raw["int64"]["tokens_per_s"],
        "ratio_to_raw_windows": loader["tokens_per_s"] / raw["windows"]["tokens_per_s"],
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "target_pass": loader["tokens_per_s"] >= TARGET_TOKENS_PER_S,
    }
    print_report(summary, console)
    if profile is not None:
        console.print(profile_report(profile), markup=False, highlight=False)
    common.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
