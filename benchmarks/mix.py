"""Output throughput of `lmforge mix` (`lmforge.prep.mix.mix_sources`) from sources in the page cache, on the CPU.

The script writes three sources of uint16 token shards in datatrove's layout (docs/data.md), `--gb` GB of tokens in
all (default 3), split 60/30/10 between `web`, `code` and `math`, whose documents have lognormal lengths of mean
200, 800 and 3,000 tokens (random ids 1..65535, each document ending with EOS, id 0); each source is `--files`
files (default 4). They go under a fresh folder inside `--work` (default: a temporary folder), which is removed at
the end. The sources are flushed to disk (`sync`) and read once before anything is timed, so the mix reads them
from the page cache.

The timed call is `mix_sources` with weights 60/30/10 and a pool of `--fraction` (default 0.9) of all the source
tokens, so each source is read at 90% of its size, its documents whole and in a random order, interleaved in
another random order: every step of the command but parsing flags (opening and checking the sources, drawing the
orders, gathering and writing `mix.ds`, its index, metadata, `.source` file and the manifest). MB/s is the bytes
of `mix.ds` written per second of that call; tokens/s likewise. Also reported: the CPU seconds the process used
during the call (its threads together) and the peak of its anonymous memory (sampled every 20 ms; the page cache
behind the memory-mapped sources does not count): the pool is gathered in bounded chunks, so what grows with the
pool is only about 40 bytes per document. Target: >= 200 MB/s of output.


    .venv/bin/python benchmarks/mix.py [--gb G] [--files N] [--fraction F] [--work DIR] [--quiet-wait S] [--json PATH]
    .venv/bin/python benchmarks/mix.py --smoke         # 10 MB of sources (a few seconds)

The script always exits 0 when the mix ran (it is a benchmark, not a test); PASS/MISS marks the target.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import common
from cpu_load import ForeignLoad, own_cpu_s, settle
from lmforge.prep.mix import SourceSpec, mix_sources

TARGET_MB_PER_S = 200.0
"""Output MB/s (10^6 bytes of `mix.ds`) the target asks for."""
EOS_ID = 0
"""End-of-document token: ends every document of every source."""
SOURCES = (("web", 200.0, 0.6), ("code", 800.0, 0.3), ("math", 3000.0, 0.1))
"""Name, mean document length (tokens) and weight of each source; the weight is also its share of the bytes."""
WRITE_CHUNK = 8 * 1024 * 1024
"""Tokens per write when making the sources."""


@dataclass(frozen=True)
class Settings:
    """The sources and the pool."""

    gb: float = 3.0
    """GB (10^9 bytes) of uint16 tokens in all the sources together."""
    files: int = 4
    """`.ds` files per source."""
    fraction: float = 0.9
    """Pool size as a fraction of all the source tokens (each source is read at this fraction of its size)."""
    doc_len_sigma: float = 1.0
    """Sigma of the lognormal document lengths (of their log)."""
    seed: int = 0
    """Seed of the sources' contents and of the mix."""


SMOKE = Settings(gb=0.01, files=2)
"""10 MB of sources: checks the script runs, in seconds."""


# ---------------------------------------------------------------------------------------------- the sources


def doc_ends(rng: np.random.Generator, n_tokens: int, mean: float, sigma: float) -> np.ndarray:
    """uint64 END offsets of lognormal-length documents (>= 1 token, mean `mean`) that fill `n_tokens` exactly."""
    mu = math.log(mean) - sigma**2 / 2
    parts, end = [], 0
    while end < n_tokens:
        lengths = np.maximum(rng.lognormal(mu, sigma, size=int(n_tokens / mean * 1.1) + 16).astype(np.int64), 1)
        ends = end + np.cumsum(lengths)
        parts.append(ends)
        end = int(ends[-1])
    ends = np.concatenate(parts)
    ends = ends[: int(np.searchsorted(ends, n_tokens)) + 1]
    ends[-1] = n_tokens  # the last document is cut to fill the file
    return ends.astype(np.uint64)


def write_file(path: Path, n_tokens: int, mean: float, rng: np.random.Generator, settings: Settings) -> int:
    """One uint16 `.ds` file (+ .index, .metadata) of `n_tokens` tokens, written in chunks; returns its documents."""
    ends = doc_ends(rng, n_tokens, mean, settings.doc_len_sigma)
    eos_at = ends.astype(np.int64) - 1
    with open(path, "wb") as f:
        for lo in range(0, n_tokens, WRITE_CHUNK):
            hi = min(lo + WRITE_CHUNK, n_tokens)
            ids = np.frombuffer(rng.bytes(2 * (hi - lo)), dtype="<u2").copy()
            np.maximum(ids, 1, out=ids)  # EOS only where a document ends
            k0, k1 = np.searchsorted(eos_at, [lo, hi])
            ids[eos_at[k0:k1] - lo] = EOS_ID
            f.write(ids.tobytes())
    common.write_shard_index(path, ends, "benchmark-word-tokenizer")
    return int(ends.size)


def make_sources(root: Path, settings: Settings) -> list[dict[str, Any]]:
    """Write the three sources under `root`; per source its name, folder, weight, files, tokens and documents."""
    rng = np.random.default_rng(settings.seed)
    total = int(settings.gb * 1e9) // 2
    made = []
    for name, mean, weight in SOURCES:
        folder = root / name
        folder.mkdir(parents=True)
        tokens = int(total * weight)
        sizes = [tokens // settings.files + (1 if k < tokens % settings.files else 0) for k in range(settings.files)]
        files = [folder / f"{k:05d}.ds" for k in range(settings.files)]
        docs = sum(write_file(p, n, mean, rng, settings) for p, n in zip(files, sizes, strict=True))
        made.append({"name": name, "folder": folder, "weight": weight, "files": files, "tokens": tokens, "docs": docs})
    return made


def warm_page_cache(files: list[Path]) -> tuple[float, int]:
    """Read every shard file (tokens, index) once so the timed mix reads from the page cache; (seconds, bytes)."""
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


# ---------------------------------------------------------------------------------------------- the mix


class AnonPeak:
    """The peak of this process's anonymous resident memory (`RssAnon`, so not the page cache behind the memory-
    mapped sources), sampled every 20 ms by a thread while in a `with` block; 0 off Linux."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now_kib() -> int:
        """RssAnon now, in KiB."""
        try:
            with open("/proc/self/status", encoding="ascii") as f:
                return next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
        except OSError:
            return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kib = max(self.peak_kib, self.now_kib())

    def __enter__(self) -> AnonPeak:
        self.peak_kib = self.now_kib()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, self.now_kib())


def run_mix(sources: list[dict[str, Any]], output: Path, settings: Settings) -> dict[str, Any]:
    """Time one `mix_sources` call; its figures."""
    specs = [SourceSpec(s["name"], str(s["folder"]), s["weight"]) for s in sources]
    tokens = int(settings.fraction * sum(s["tokens"] for s in sources))
    load = ForeignLoad()
    before_kib = AnonPeak.now_kib()
    with AnonPeak() as memory:
        cpu0, t0 = own_cpu_s(), time.perf_counter()
        manifest = mix_sources(specs, tokens, output, seed=settings.seed)
        seconds, cpu_s = time.perf_counter() - t0, own_cpu_s() - cpu0
    out_bytes = (output / "mix.ds").stat().st_size
    return {
        "tokens_requested": tokens,
        "tokens": manifest.tokens,
        "documents": manifest.documents,
        "bytes": out_bytes,
        "seconds": seconds,
        "mb_per_s": out_bytes / 1e6 / seconds,
        "tokens_per_s": manifest.tokens / seconds,
        "shares": {s.name: s.tokens / manifest.tokens for s in manifest.sources},
        "cpu_s": cpu_s,
        "anon_before_mib": before_kib / 1024,
        "anon_peak_mib": memory.peak_kib / 1024,
        "foreign_cores": load.cores(seconds) if seconds >= 1.0 else None,
    }


# ---------------------------------------------------------------------------------------------- report


def print_report(summary: dict[str, Any], console: Any) -> None:
    """The table: the sources, the pool, the throughput and the target verdict."""
    mix, sources = summary["mix"], summary["sources"]
    title = (
        f"lmforge mix: {len(sources)} sources, {sum(s['tokens'] for s in sources) * 2 / 1e9:.2f} GB of uint16 "
        f"tokens from the page cache -> a pool of {mix['bytes'] / 1e9:.2f} GB"
    )
    table = common.result_table(title, ("source", "mean doc", "documents", "tokens", "weight", "share in pool"))
    for s in sources:
        table.add_row(
            s["name"],
            f"{s['mean_doc']:,.0f}",
            f"{s['docs']:,}",
            f"{s['tokens']:,}",
            f"{s['weight']:.0%}",
            f"{mix['shares'][s['name']]:.3%}",
        )
    table.add_section()
    table.add_row("pool", "", f"{mix['documents']:,}", f"{mix['tokens']:,}", "", "")
    table.add_row("seconds", "", "", f"{mix['seconds']:.2f}", "", "")
    table.add_row("tokens/s", "", "", f"{mix['tokens_per_s']:,.0f}", "", "")
    table.add_row("MB/s of output", "", "", f"{mix['mb_per_s']:,.0f}", f">= {TARGET_MB_PER_S:g}", "")
    table.add_row("target", "", "", "", "", common.verdict(summary["target_pass"]), style="bold")
    console.print(table)
    warm = summary["warm"]
    console.print(
        f"sources written in {summary['write_s']:.1f} s; page cache warmed first: {warm['bytes'] / 2**20:,.0f} MiB "
        f"read in {warm['seconds']:.2f} s; the mix used {mix['cpu_s']:.1f} CPU seconds (all threads) in "
        f"{mix['seconds']:.1f} s; anonymous memory {mix['anon_before_mib']:,.0f} MiB before, peak "
        f"{mix['anon_peak_mib']:,.0f} MiB during the mix",
        highlight=False,
    )
    if mix["foreign_cores"] is not None and mix["foreign_cores"] > 0.1:
        console.print(
            f"[yellow]other processes kept {mix['foreign_cores']:.2f} cores busy during the mix: its figure may be "
            "low; rerun on an idle machine[/]"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; unset ones take the defaults of the chosen size."""
    presets = {"default": Settings(), "smoke": SMOKE}
    p = common.benchmark_parser(
        __doc__, presets, "10 MB of sources: checks the script runs", quiet_wait="before the mix"
    )
    p.add_argument("--gb", type=float, default=None, help="GB of tokens in all the sources (default 3; smoke 0.01)")
    p.add_argument("--files", type=int, default=None, help=".ds files per source (default 4; smoke 2)")
    p.add_argument("--fraction", type=float, default=None, help="pool size / source tokens, in (0, 1] (default 0.9)")
    p.add_argument("--work", type=Path, default=None, help="folder for the sources and the pool (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the sources, warm the page cache, time the mix, print the table, optionally write the JSON."""
    args = parse_args(argv)
    base = SMOKE if args.smoke else Settings()
    overrides = {"gb": args.gb, "files": args.files, "fraction": args.fraction}
    settings = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if not 0 < settings.fraction <= 1 or settings.gb <= 0 or settings.files < 1:
        print("mix.py: --gb must be > 0, --files >= 1 and --fraction in (0, 1]", file=sys.stderr)
        return 2
    console = common.make_console()
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="lmforge-mix-bench-", dir=args.work))
    try:
        t0 = time.perf_counter()
        sources = make_sources(root / "sources", settings)
        os.sync()  # the pool's writes must not wait behind the sources' dirty pages
        write_s = time.perf_counter() - t0
        warm_s, warm_bytes = warm_page_cache([p for s in sources for p in s["files"]])
        busy = settle(common.quiet_wait_s(args))
        if busy is not None:
            console.print(f"CPUs before timing: {busy:.2f} cores busy", highlight=False)
        mix = run_mix(sources, root / "pool", settings)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "settings": asdict(settings),
        "sources": [
            {**{k: v for k, v in s.items() if k not in ("folder", "files")}, "mean_doc": mean}
            for s, (_, mean, _) in zip(sources, SOURCES, strict=True)
        ],
        "write_s": write_s,
        "warm": {"seconds": warm_s, "bytes": warm_bytes},
        "mix": mix,
        "target_mb_per_s": TARGET_MB_PER_S,
        "target_pass": mix["mb_per_s"] >= TARGET_MB_PER_S,
    }
    print_report(summary, console)
    common.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
