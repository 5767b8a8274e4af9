"""The benchmark scripts keep running (tiny sizes; their figures are recorded in docs/benchmarks.md).

`BENCHMARKS` holds one row per script: its arguments after `--smoke`, its timeout, and the check of its figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]

Result = subprocess.CompletedProcess[str]


def run_benchmark(tmp_path: Path, script: str, *args: str, timeout: float, name: str = "") -> tuple[Any, Result]:
    """Run `benchmarks/<script> <args> --json <tmp_path>/<name>.json` (name: the script's stem unless given), check
    that it exits 0 and return the figures it wrote and the finished process."""
    out = tmp_path / f"{name or Path(script).stem}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text()), result


def check_overhead(figures: Any, result: Result, tmp_path: Path) -> None:
    """`overhead.py --smoke` trains the same model on every side, under both allocator settings."""
    sides = ("lmforge", "lmforge_compiled", "plain_eager", "plain_compiled")
    assert set(figures["best"]) == {"lmforge", "default"}  # lmforge's malloc setting for all sides, and glibc's
    for allocator, best in figures["best"].items():
        assert all(best[side]["tokens_per_s"] > 0 for side in sides), allocator
        # eager is set against eager, compiled against compiled
        assert figures["ratios"][allocator]["lmforge"] == pytest.approx(
            best["lmforge"]["tokens_per_s"] / best["plain_eager"]["tokens_per_s"]
        )
        assert set(figures["ratios"][allocator]) == {"lmforge", "lmforge_compiled"}
    # every side starts from the same weights and data, so the losses agree (compiled: up to float rounding)
    for side in sides[1:]:
        assert figures["first_loss"][side] == pytest.approx(figures["first_loss"]["lmforge"], abs=1e-5)
        assert figures["max_loss_diff"][side] < 1e-4
    # the step-by-step comparisons in one process: 3 rounds of one step per side, under the first allocator setting
    pairs = {"lmforge": "plain_eager", "lmforge_compiled": "plain_compiled"}
    assert set(figures["interleaved"]) == set(pairs)
    for ours, theirs in pairs.items():
        mixed = figures["interleaved"][ours]
        assert mixed["rounds"] == 3 and mixed["allocator"] == "lmforge"
        assert mixed["ratio"] == pytest.approx(mixed["median_step_s"][theirs] / mixed["median_step_s"][ours])
    assert "lmforge and plain eager step by step in one process (3 rounds" in result.stdout
    assert "lmforge compiled and plain compiled step by step" in result.stdout


def check_peers(figures: Any, result: Result, tmp_path: Path) -> None:
    """`peers.py --smoke` trains the tiny model with lmforge (1 and 2 processes) and the plain loop under both
    allocator settings, from the same initial weights and token windows (the same first loss), reports the peers as
    skipped without installing them, and with `--profile` writes each side's table of top operators."""
    out, profiles = tmp_path / "peers.json", tmp_path / "profiles"  # where run_benchmark and the row put them
    every = {(row["allocator"], row["side"], row["procs"]): row for row in figures["sides"]}
    assert {key[0] for key in every} == {"lmforge", "default"}  # every side under each setting, compared within it
    rows = {key[1:]: row for key, row in every.items() if key[0] == "lmforge"}
    for side in (("lmforge", 1), ("lmforge", 2), ("lmforge doc-masked", 1), ("plain eager", 1)):
        assert rows[side]["status"] == "ok", rows[side]["reason"]
        assert rows[side]["tokens_per_s"] > 0 and rows[side]["peak_rss_mib"] > 0
        assert len(rows[side]["step_tokens_per_s"]) == 3  # 1 warmup + 2 timed steps
        assert every[("default", *side)]["status"] == "ok"
    assert rows[("plain eager", 1)]["lmforge_over_side"] > 0
    # every side counts the parameters of the model it built, and they must equal lmforge's
    assert rows[("lmforge", 1)]["params"] > 0 and rows[("plain eager", 1)]["same_params"] is True
    assert all(math.isfinite(rows[side]["first_loss"]) for side in (("lmforge", 1), ("plain eager", 1)))
    # ... and starts from lmforge's weights on lmforge's windows: the same first loss (within 1e-4), on 1 and 2 ranks
    assert rows[("plain eager", 1)]["same_first_loss"] is True and rows[("plain eager", 1)]["first_loss_diff"] < 1e-4
    assert abs(rows[("lmforge", 2)]["first_loss"] - rows[("lmforge", 1)]["first_loss"]) < 1e-4
    assert rows[("lmforge doc-masked", 1)]["same_first_loss"] is None  # other attention: not compared
    assert "NOT THE SAME" not in result.stdout
    peers = [row for row in rows.values() if row["side"] in ("torchtitan", "litgpt")]
    assert {(row["side"], row["procs"]) for row in peers} == {(p, n) for p in ("torchtitan", "litgpt") for n in (1, 2)}
    assert all(row["status"] == "skipped" for row in peers)
    assert rows[("torchtitan", 1)]["reason"] == "--smoke does not install peers"
    assert "lmforge" in result.stdout and "plain eager" in result.stdout and "skipped" in result.stdout
    assert "glibc's defaults for every side" in result.stdout and "lmforge's malloc setting" in result.stdout
    assert sorted(p.name for p in profiles.iterdir()) == [
        "lmforge-1.txt",
        "lmforge-2.txt",
        "lmforge-doc-masked-1.txt",
        "plain-eager-1.txt",
    ]
    for table in profiles.iterdir():
        text = table.read_text()
        assert text.startswith("optimizer steps 2..3") and "aten::mm" in text, text[:500]
    # --merge pools the runs of earlier invocations: the same file twice doubles each side's runs, not its median.
    merged, _ = run_benchmark(tmp_path, "peers.py", "--merge", str(out), str(out), timeout=60, name="merged")
    pooled = {(row["allocator"], row["side"], row["procs"]): row for row in merged["sides"]}
    assert len(merged["runs"]) == 2 * len(figures["runs"])
    for key in every:
        if every[key]["status"] == "ok":
            assert pooled[key]["tokens_per_s"] == pytest.approx(every[key]["tokens_per_s"])
    assert pooled[("lmforge", "torchtitan", 1)]["status"] == "skipped"


def check_attention_switch(figures: Any, result: Result, tmp_path: Path) -> None:
    """`attention_switch.py --smoke` reports both backends."""
    rows = figures["rows"]
    assert [(r["tokens"], r["segments"]) for r in rows] == [(256, 1), (256, 4), (256, 32)]
    assert all(r["loop_ms"] > 0 and r["dense_ms"] > 0 for r in rows)
    assert "per-segment" in result.stdout and "masked" in result.stdout


def check_data(figures: Any, result: Result, tmp_path: Path) -> None:
    settings, loader, raw = figures["settings"], figures["loader"], figures["raw"]
    assert loader["tokens_per_s"] > 0
    assert all(raw[side]["tokens_per_s"] > 0 for side in ("uint16", "int64", "windows"))
    # every timed step handed over this rank's full share of the batch, in full micro-batches
    assert loader["tokens"] == loader["steps"] * settings["batch_tokens"] // settings["world_size"] > 0
    per_step = settings["batch_tokens"] // (settings["micro_batch_tokens"] * settings["world_size"])
    assert loader["micro_batches"] == loader["steps"] * per_step
    # the pool it wrote has the size asked for, and its segments follow its documents (EOS at each segment end)
    assert figures["pool"]["tokens"] == settings["tokens"]
    assert loader["boundaries_ok"]
    mean_segments = settings["seq_len"] / settings["mean_doc_len"] + 1  # documents a window overlaps, on average
    assert 0.7 * mean_segments < loader["segments_per_window"] < 1.3 * mean_segments
    # the raw sides copied at least as many tokens as the loader produced
    assert min(raw[side]["tokens"] for side in ("uint16", "int64", "windows")) >= loader["tokens"]


def check_checkpoint(figures: Any, result: Result, tmp_path: Path) -> None:
    best = figures["best"]
    assert best["sync"]["total_s"] > 0
    assert best["sync"]["bytes"] > 0 and best["async"]["bytes"] > 0 and best["load"]["bytes"] > 0
    # an async save blocks the caller for part of the time the checkpoint takes to commit, never longer
    assert 0 < best["async"]["blocked_s"] <= best["async"]["total_s"]
    # the loaded parameters and optimizer state equal those that were saved
    assert best["load"]["verified"] is True


def check_lr_transfer(figures: Any, result: Result, tmp_path: Path) -> None:
    settings = figures["settings"]
    assert figures["runs"]
    assert all(math.isfinite(run["heldout_loss"]) and math.isfinite(run["train_loss"]) for run in figures["runs"])
    # every scheme has a best lr at every width, and a spread across the widths
    for scheme in ("normal", "completep"):
        widths = figures["transfer"][scheme]["widths"]
        assert sorted(widths) == sorted(str(w) for w in settings["widths"])
        assert all(w["best_lr_exp"] in w["lr_exps"] and math.isfinite(w["best_loss"]) for w in widths.values())
        assert figures["transfer"][scheme]["spread_steps"] >= 0
    # each optimizer either reached the target loss (at some number of tokens) or says it did not
    muon = figures["muon"]
    assert math.isfinite(muon["target_loss"])
    for opt in ("adamw", "muon"):
        assert muon[opt]["best_lr_exp"] is not None and muon[opt]["curve"]
        tokens = muon[opt]["tokens_to_target"]
        in_run = tokens is not None and 0 <= tokens <= settings["steps"] * settings["batch_tokens"]
        assert in_run == muon[opt]["reached"]
    assert muon["adamw"]["reached"]  # the target is AdamW's own final loss plus a margin


def check_logging_cost(figures: Any, result: Result, tmp_path: Path) -> None:
    sides = {r["side"]: r for r in figures["runs"]}
    assert sides["off"]["monitors"] == []
    assert {"ConsoleMonitor", "JsonlMonitor", "WandbMonitor"} <= set(sides["on"]["monitors"])
    assert all(r["median_step_s"] > 0 for r in figures["runs"]) and figures["ratio"] > 0


def check_gpu(figures: Any, result: Result, tmp_path: Path) -> None:
    rows = figures["rows"]
    assert [(r["size"], r["fp8"], r["experts"]) for r in rows] == [
        ("smoke", "none", 0), ("smoke+tensorwise", "tensorwise", 0), ("smoke-moe", "none", 8)
    ]  # fmt: skip
    for row in rows:
        assert "error" not in row, row.get("traceback")
        assert row["tokens_per_s"] > 0 and row["params"] > 0 and row["median_step_s"] > 0
        assert row["attn_backend"] == "auto"  # on the CPU, `auto` chooses per row
        assert row["mfu_pct"] is None  # no bf16 peak on the CPU
        # the plan of the same step, beside it; no measured GPU figures to compare with on the CPU
        assert "plan_error" not in row, row.get("plan_error")
        assert row["plan_peak_gib"] > 0 and row["plan_step_s"] > 0 and "plan_time_ratio" not in row
    assert rows[2]["params"] > rows[0]["params"]  # the experts are there


def check_evals(figures: Any, result: Result, tmp_path: Path) -> None:
    seq_len, row_tokens = figures["settings"]["seq_len"], figures["settings"]["row_tokens"]
    for f in figures["sets"].values():
        assert f["validation"]["tokens_per_s"] > 0 and f["plain"]["tokens_per_s"] > 0 and f["ratio"] > 0
        assert f["positions"] == f["rows"] * row_tokens  # both sides count the same full rows
    heldout, quiz = figures["sets"]["heldout"], figures["sets"]["quiz"]
    # every token of the written documents but each L-token chunk's first is scored once
    chunks = sum(math.ceil(n / seq_len) for n in heldout["doc_lengths"])
    assert heldout["scored_tokens"] == sum(heldout["doc_lengths"]) - chunks > 0
    # the validator's loss is the one the plain logits give on the same rows
    assert heldout["loss_diff"] < 1e-4 and math.isfinite(heldout["loss"])
    # the ctxcont rows score exactly the continuations' tokens, with the plain logits' log-likelihoods
    assert quiz["scored_tokens"] == quiz["expected_scored_tokens"] > 0
    assert quiz["loglik_diff"] < 1e-3 and 0 <= quiz["acc"] <= 1
    assert all(f["median_s"] > 0 for f in figures["heads"].values())


def check_moe(figures: Any, result: Result, tmp_path: Path) -> None:
    sides = figures["sides"]
    assert set(sides) == {"dense", "moe_grouped_mm", "moe_loop"}
    assert all(f["tokens_per_s"] > 0 and f["median_step_s"] > 0 for f in sides.values())
    assert figures["moe_over_dense"] > 0 and figures["grouped_over_loop"] > 0
    # the dense MLP is (top_k + shared) experts wide, so a token multiplies as many weights on both sides: the
    # count_params figures differ by exactly the MoE's routers (experts x hidden per layer)
    settings, params = figures["settings"], figures["params"]
    router = settings["num_hidden_layers"] * settings["n_routed_experts"] * settings["hidden_size"]
    assert params["moe"]["router"] == router
    assert params["moe"]["active_matmul"] - router == params["dense"]["active_matmul"] > 0
    assert figures["active_matmul_equal"] is True
    # the MoE holds more weights than it uses per token
    assert params["moe"]["total"] > params["dense"]["total"]
    # the same weights and tokens through the grouped matmuls and the per-expert loop give the same loss
    assert figures["first_loss_diff_grouped_loop"] < 1e-4


def check_mix(figures: Any, result: Result, tmp_path: Path) -> None:
    """`mix.py --smoke` writes a pool in the asked shares."""
    mix = figures["mix"]
    assert mix["mb_per_s"] > 0 and mix["bytes"] == 2 * mix["tokens"]  # uint16 tokens
    assert abs(mix["tokens"] - mix["tokens_requested"]) < 3 * 3000  # within a document per source
    for source in figures["sources"]:
        assert mix["shares"][source["name"]] == pytest.approx(source["weight"], abs=0.002)


def check_context_parallel(figures: Any, result: Result, tmp_path: Path) -> None:
    rows = {(r["seq_len"], r["cp"]): r for r in figures["rows"]}
    assert set(rows) == {(128, 1), (128, 2), (256, 1), (256, 2)}
    for seq_len in (128, 256):
        one, two = rows[(seq_len, 1)], rows[(seq_len, 2)]
        assert one["gathered"] == 0 < two["gathered"] and one["step"] > 0 and two["step"] > 0
        assert two["activations"] < 0.75 * one["activations"]  # split over two ranks
    assert rows[(256, 2)]["gathered"] == 2 * rows[(128, 2)]["gathered"]  # keys and values of the whole row


def check_expert_parallel(figures: Any, result: Result, tmp_path: Path) -> None:
    rows = {(r["experts"], r["ep"]): r for r in figures["rows"]}
    assert set(rows) == {(4, 1), (4, 2), (8, 1), (8, 2)}
    for experts in (4, 8):
        one, two = rows[(experts, 1)], rows[(experts, 2)]
        assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
        # only ep = 2 exchanges token copies (and plans the exchange); ep = 1 has nobody to send them to
        assert one["a2a_bytes"] == one["count_bytes"] == 0 < two["a2a_remote_bytes"] <= two["a2a_bytes"]
        assert two["count_bytes"] > 0 and two["plan_s"] > 0
        # each rank computes with half the experts at ep = 2; FSDP already splits the held shards at ep = 1
        assert two["expert_weight_bytes"] * 2 == one["expert_weight_bytes"] > 0
        assert two["expert_shard_bytes"] == one["expert_shard_bytes"] == one["expert_weight_bytes"] // 2
        # without the experts' FSDP traffic, ep = 2 gathers less
        assert two["gather_bytes"] < one["gather_bytes"]


def check_tensor_parallel(figures: Any, result: Result, tmp_path: Path) -> None:
    rows = {r["tp"]: r for r in figures["rows"]}
    assert set(rows) == {1, 2}
    one, two = rows[1], rows[2]
    # the split weights, their gradients and AdamW's state halve (norm scales, held whole, are a few hundred bytes)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert two[key] == pytest.approx(one[key] / 2, rel=0.01), key
    assert two["activation_bytes"] < 0.75 * one["activation_bytes"]
    # one process has nobody to talk to; a TP pair gathers and scatters tokens in every block
    assert all(one[f"{kind}_bytes"] == 0 for kind in ("all_gather", "reduce_scatter", "all_reduce"))
    assert two["all_gather_bytes"] > 0 and two["reduce_scatter_bytes"] > 0 and two["all_reduce_bytes"] > 0
    assert one["step_s"] > 0 and two["step_s"] > 0


def check_pipeline_parallel(figures: Any, result: Result, tmp_path: Path) -> None:
    """`pipeline_parallel.py --smoke` runs one process and pp 2 with every schedule, each with one process's
    first-step loss and a measured bubble between 0 and 1."""
    rows = figures["rows"]
    assert [(r["pp"], r["schedule"]) for r in rows] == [(1, "-"), (2, "1f1b"), (2, "interleaved_1f1b"),
                                                        (2, "interleaved_zb"), (2, "zbv")]  # fmt: skip
    assert figures["loss_check"]
    for row in rows[1:]:
        assert row["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-5)
        assert 0 < row["bubble"] < 1 and 0 < row["theory"] < 1
        assert len(row["peak_gib"]) == 2 and min(row["peak_gib"]) > 0


def check_moe_options(figures: Any, result: Result, tmp_path: Path) -> None:
    """`moe_options.py --smoke` trains the baseline, the headwise output gate and null experts on the demo data, and
    each option's parameters differ from the baseline's by what the option adds."""
    s = figures["settings"]
    rows = {r["variant"]: r for r in figures["rows"]}
    assert list(rows) == ["baseline", "gate_headwise", "null_experts"] and figures["skipped"] == {}
    assert [(r["variant"], r["seed"]) for r in figures["runs"]] == [(v, 0) for v in rows]
    assert figures["tokens_per_run"] == (s["warmup"] + s["steps"]) * s["batch_tokens"]
    for run in figures["runs"]:
        assert "error" not in run and len(run["step_tokens_per_s"]) == s["warmup"] + s["steps"]
        assert math.isfinite(run["heldout_loss"]) and math.isfinite(run["train_loss"])
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["seeds"] == [0]
        assert row["heldout_loss_mean"] == row["heldout_losses"][0] and row["heldout_loss_std"] == 0
    base, gate, null = rows["baseline"], rows["gate_headwise"], rows["null_experts"]
    # the options change what the model computes: same init seed and tokens, another held-out loss
    assert gate["seed_deltas"][0] == gate["heldout_loss_mean"] - base["heldout_loss_mean"] != 0
    assert null["seed_deltas"][0] != 0 and not gate["same_as_baseline"] and not null["same_as_baseline"]
    h, layers, heads = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"]
    moe_blocks = layers - s["first_k_dense_replace"]
    # headwise gate: a g_proj [heads, hidden] in every block's attention, which every token uses
    assert gate["params_delta"] == gate["params"]["total"] - base["params"]["total"] == layers * heads * h
    assert gate["params"]["active_non_embedding"] - base["params"]["active_non_embedding"] == layers * heads * h
    # null experts: one router row [hidden] each, and a token's top-k now falls on a real expert with probability
    # n / (n + nulls), so it uses fewer routed experts (each a SwiGLU of 3 x hidden x width weights)
    assert null["flags"] == figures["options"]["null_experts"]
    nulls = int(null["flags"][0].split("=")[1])
    n, k, width = s["n_routed_experts"], s["top_k"], s["moe_intermediate_size"]
    assert null["params_delta"] == moe_blocks * nulls * h
    fewer = moe_blocks * (k - k * n / (n + nulls)) * 3 * h * width
    active = base["params"]["active_non_embedding"] + moe_blocks * nulls * h - fewer
    assert null["params"]["active_non_embedding"] == pytest.approx(active)
    assert "gate_headwise" in result.stdout and "| `null_experts` |" in result.stdout


def check_speedrun(figures: Any, result: Result, tmp_path: Path) -> None:
    """`speedrun.py --smoke` sweeps the baseline's lr, sets the target from its best run, reads lmforge's time to
    target off its own validation, and `lmforge eval --model` scores the baseline's export as the baseline did."""

    def reach(curve: list[list[float]], target: float) -> float:
        # the first evaluation at or under the target, the time linear between it and the one before
        hit = next((i for i, c in enumerate(curve) if c[3] <= target), None)
        if hit is None or hit == 0:
            return math.inf if hit is None else curve[0][2]
        (_, _, t0, l0), (_, _, t1, l1) = curve[hit - 1], curve[hit]
        return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)

    s = figures["settings"]
    assert figures["baseline_steps"] == s["steps"]
    lrs = [row["lr"] for row in figures["sweep"]]
    best = min(figures["sweep"], key=lambda row: row["best_heldout"])
    assert figures["best_lr"] == best["lr"] and figures["target"] == best["best_heldout"]
    # the sweep: the lrs asked for, and one 2x beyond an edge while the best sat at that edge
    assert lrs == sorted(lrs) and set(s["baseline_lrs"]) <= set(lrs)
    assert lrs[0] < best["lr"] < lrs[-1] or len(lrs) == len(s["baseline_lrs"]) + s["max_extend"]
    assert all(lr * 2 in lrs or lr / 2 in lrs for lr in set(lrs) - set(s["baseline_lrs"]))
    (base,) = figures["baseline"]
    evals = [c[0] for c in base["curve"]]
    assert evals == list(range(0, s["steps"] + 1, s["eval_every"]))
    assert base["time_to_target"] == pytest.approx(reach(base["curve"], figures["target"]))
    assert base["time_to_target"] <= base["train_s"]
    assert [r["steps"] for r in figures["lmforge"]] == [round(f * s["steps"]) for f in s["fractions"]]
    # lmforge's lr: the best of its sweep at seed 0 in the longest run, then every run at that lr
    ours_best = min(figures["lmforge_sweep"], key=lambda row: row["best_heldout"])
    ours_lrs = [row["lr"] for row in figures["lmforge_sweep"]]
    assert ours_lrs[: len(s["lmforge_lrs"])] == s["lmforge_lrs"]
    assert len(ours_lrs) <= len(s["lmforge_lrs"]) + s["max_extend"]
    assert figures["lmforge_lr"] == ours_best["lr"] and {r["lr"] for r in figures["lmforge"]} == {ours_best["lr"]}
    for run in figures["lmforge"]:
        assert [c[0] for c in run["curve"]] == list(range(s["eval_every"], run["steps"] + 1, s["eval_every"]))
        assert run["curve"][-1][2] == pytest.approx(run["train_s"])
        assert run["curve"][-1][1] == run["steps"] * s["batch_tokens"]
        assert run["time_to_target"] == pytest.approx(reach(run["curve"], figures["target"]))
    ours = min(r["time_to_target"] for r in figures["lmforge"])
    assert figures["time_to_target"]["lmforge"]["median"] == ours
    assert figures["ratio"] == (ours / base["time_to_target"] if math.isfinite(ours) else math.inf)
    # the two scorers: the baseline's own held-out loss of its final weights and `lmforge eval --model`'s
    scorers = figures["scorers"]
    assert scorers["baseline"] == best["final_heldout"] and scorers["diff"] <= 1e-3 and scorers["agree"]
    assert "Time to held-out loss" in result.stdout and "lmforge eval" in result.stdout


def check_speedrun_ablations(figures: Any, result: Result, tmp_path: Path) -> None:
    """`speedrun_ablations.py --smoke` runs a tiny speedrun, then the default recipe and two options at its target
    and lr; each option's Δs are its own figures minus the default's, seed by seed."""
    rows = {r["arm"]: r for r in figures["rows"]}
    assert list(rows) == ["default", "relu2", "z_loss"] and figures["settings"]["seeds"] == [0]
    assert figures["options"] == {"relu2": ["--model.arch.hidden_act", "relu2"], "z_loss": ["--model.z_loss", "1e-4"]}
    runs = figures["runs"]
    for arm, row in rows.items():
        (run,) = runs[arm]["0"]
        assert run["flags"] == (figures["options"][arm] if arm != "default" else [])
        assert run["lr"] == figures["lmforge_lr"] and run["steps"] == figures["baseline_steps"]
        assert row["losses"] == [run["final_heldout"]] and row["times"] == [run["time_to_target"]]
    base = rows["default"]
    for arm in ("relu2", "z_loss"):
        row = rows[arm]
        assert row["loss_deltas"] == [row["losses"][0] - base["losses"][0]] != [0.0], arm
        assert row["step_time_ratio"] == pytest.approx(row["step_s"] / base["step_s"])
    assert "Ablations: target" in result.stdout and "relu2" in result.stdout


Check = Callable[[Any, Result, Path], None]

# One row per script: its name under benchmarks/, the arguments after `--smoke` (`{tmp}` stands for the test's
# tmp_path; run_benchmark appends `--json`), the timeout in seconds, and the check of what it wrote and printed.
# An id is also a keyword, and tests/conftest.py skips items with the keyword `gpu` without CUDA: not `id="gpu"`.
# The six heaviest smokes (45 s to 3.5 minutes each on two cores) are `long`: CI runs the others, LMFORGE_LONG=1
# all.
BENCHMARKS = [
    pytest.param("overhead.py", ["--no-live-memory"], 240, check_overhead, id="overhead", marks=pytest.mark.long),
    pytest.param("peers.py", ["--profile", "{tmp}/profiles", "--quiet-wait", "0"], 240, check_peers, id="peers",
                 marks=pytest.mark.long),
    pytest.param("attention_switch.py", [], 120, check_attention_switch, id="attention_switch"),
    pytest.param("data.py", ["--pool-dir", "{tmp}/pool"], 120, check_data, id="data"),
    pytest.param("checkpoint.py", ["--dir", "{tmp}/ckpt"], 120, check_checkpoint, id="checkpoint"),
    pytest.param("lr_transfer.py", ["--data-dir", "{tmp}/demo"], 240, check_lr_transfer, id="lr_transfer",
                 marks=pytest.mark.long),
    pytest.param("logging_cost.py", [], 240, check_logging_cost, id="logging_cost"),
    pytest.param("gpu.py", [], 240, check_gpu, id="gpu_benchmark"),
    pytest.param("evals.py", [], 180, check_evals, id="evals"),
    pytest.param("moe.py", [], 180, check_moe, id="moe"),
    pytest.param("mix.py", [], 120, check_mix, id="mix"),
    pytest.param("context_parallel.py", [], 180, check_context_parallel, id="context_parallel"),
    pytest.param("expert_parallel.py", [], 300, check_expert_parallel, id="expert_parallel", marks=pytest.mark.long),
    pytest.param("tensor_parallel.py", [], 180, check_tensor_parallel, id="tensor_parallel"),
    pytest.param("pipeline_parallel.py", [], 240, check_pipeline_parallel, id="pipeline_parallel",
                 marks=pytest.mark.long),
    pytest.param("moe_options.py", ["--data-dir", "{tmp}/demo"], 240, check_moe_options, id="moe_options",
                 marks=pytest.mark.long),
    pytest.param("speedrun.py", ["--data-dir", "{tmp}/demo"], 300, check_speedrun, id="speedrun"),
    pytest.param("speedrun_ablations.py", ["--data-dir", "{tmp}/demo"], 300, check_speedrun_ablations,
                 id="speedrun_ablations", marks=pytest.mark.long),
]


@pytest.mark.parametrize(("script", "args", "timeout", "check"), BENCHMARKS)
def test_benchmark_smoke(tmp_path: Path, script: str, args: list[str], timeout: float, check: Check) -> None:
    """`<script> --smoke` exits 0 and writes figures that pass its row's check."""
    args = [arg.format(tmp=tmp_path) for arg in args]
    figures, result = run_benchmark(tmp_path, script, "--smoke", *args, timeout=timeout)
    check(figures, result, tmp_path)


def test_a_failed_child_comes_back_as_an_error() -> None:
    """`run_in_child` answers for a child that raised, died or ran too long, instead of waiting on it forever."""
    # Run in a fresh interpreter: `benchmarks/` goes on its path there, not on the test session's.
    script = textwrap.dedent(
        f"""
        import json, os, sys, time
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        import common
        results = {{
            "ok": common.run_in_child(dict, (), "ok"),
            "raised": common.run_in_child(int, ("x",), "raised"),
            "died": common.run_in_child(os._exit, (3,), "died"),
            "slow": common.run_in_child(time.sleep, (30,), "slow", timeout=1),
        }}
        print(json.dumps(results))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert results["ok"] == {}  # an empty result is a result, not a failure
    assert results["raised"]["error"].startswith("ValueError") and "traceback" in results["raised"]
    assert results["died"]["error"] == "the process exited with code 3 without a result"
    assert results["slow"]["error"] == "timed out after 1 s"
