"""`lmforge plot` and `lmforge report` on run directories written here, the report opened in headless Chromium."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from lmforge.commands.plot import main as plot_main
from lmforge.commands.report import main as report_main
from lmforge.viz import PANEL_IDS, RunError, ema, load_run, select_metrics
from lmforge.viz.report import render_report

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GROUPS = ("hidden", "embed", "head", "norm")
CONFIG = 'max_steps = 50\noutput_dir = "{out}"\n\n[optim]\nlr = 0.003\nmax_norm = 1.0\n'


def _fake_records(steps: int, seed: float) -> list[dict[str, Any]]:
    """Plausible metric records: a falling loss with noise, a warmup/decay schedule, a few nulls and gaps."""
    records: list[dict[str, Any]] = [{"step": 0, "params/total": 124_439_808.0, "params/embedding": 38_597_376.0}]
    tokens = 0.0
    for step in range(1, steps + 1):
        loss = 6.5 * math.exp(-step / 40) + 3.0 + 0.05 * math.sin(step * seed)
        lr = 3e-3 * min(1.0, step / 10) * (1 - step / (2 * steps))
        tokens += 4096
        grad = 1.5 * math.exp(-step / 30) + 0.2 + 0.02 * math.cos(step * seed)
        r: dict[str, Any] = {
            "step": step,
            "loss/mean": loss,
            "loss/perplexity": math.exp(loss),
            "loss/nan_count": 0.0,
            "loss/spike": 1.0 if step == 23 else 0.0,
            "optim/lr": lr,
            "optim/grad_norm": grad,
            "optim/grad_norm_spike": 1.0 if step == 31 else 0.0,
            "perf/throughput": 8000 + 50 * math.sin(step),
            "perf/throughput_per_device": 4000 + 25 * math.sin(step),
            "perf/mfu": 0.41 + 0.01 * math.sin(step),
            "perf/mfu_6nd": 0.38 + 0.01 * math.sin(step),
            "perf/peak_memory": 12.5,
            "time/step": 0.5 + 0.01 * math.cos(step),
            "time/data/max": 0.002,
            "time/data/mean": 0.001,
            "progress/num_tokens": tokens,
            "progress/epoch": 0.0,
            "max_vio/mean": 0.3 * math.exp(-step / 20),
            "max_vio/max": 0.6 * math.exp(-step / 20),
            "routing_confidence/mean": 0.5 + step / 200,
        }
        for i, group in enumerate(GROUPS):
            r[f"optim/lr/{group}"] = lr * (1 + i) / len(GROUPS)
            r[f"optim/grad_norm/{group}"] = grad / (2 + i)
        for expert in range(4):
            r[f"expert_load/layer_0/expert_{expert}"] = 0.25 + 0.02 * (expert - 1.5) * math.exp(-step / 25)
        if step % 10 == 0:
            r["val/loss"] = loss + 0.1
            r["val/perplexity"] = math.exp(loss + 0.1)
            r["val/fineweb/bpb@1024"] = (loss + 0.1) / math.log(2) / 4.2
            r["val/fineweb/loss@1024"] = loss + 0.1
            r["val/hellaswag/acc_norm@1024"] = 0.25 + step / 1000
            r["time/val"] = 1.7
        if step % 25 == 0:
            r["time/save_ckpt"] = 0.8
        if step == 17:
            r["loss/mean"] = None  # a step whose every micro-batch was non-finite
            r["optim/grad_norm"] = None
        if step == 33:
            del r["perf/mfu"], r["perf/mfu_6nd"]  # a record without some keys
        records.append(r)
    return records


def make_run(root: Path, name: str, steps: int = 50, seed: float = 1.3) -> Path:
    """A run directory as training leaves it: config.toml and metrics.jsonl (nulls for non-finite values)."""
    out = root / name
    out.mkdir(parents=True)
    (out / "config.toml").write_text(CONFIG.format(out=out), encoding="utf-8")
    lines = [json.dumps(r) for r in _fake_records(steps, seed)]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def test_load_run_series_and_selection(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path, "a"))
    assert run.name == "a" and run.config["optim"]["lr"] == 0.003 and "max_steps = 50" in (run.config_text or "")
    steps, values = run.series("loss/mean")
    assert steps == [s for s in range(1, 51) if s != 17] and len(values) == 49  # the null is skipped
    assert run.series("val/loss")[0] == [10, 20, 30, 40, 50]
    assert run.series("params/total") == ([0], [124_439_808.0])
    assert len(run.series("perf/mfu")[0]) == 49  # the record without it is skipped
    hits = select_metrics(run.metric_names(), ["val/*/bpb@*", "optim/lr/*", "nothing/*"])
    assert hits == {
        "val/*/bpb@*": ["val/fineweb/bpb@1024"],
        "optim/lr/*": [f"optim/lr/{g}" for g in sorted(GROUPS)],
        "nothing/*": [],
    }


def test_ema() -> None:
    assert ema([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    assert ema([5.0] * 20, 0.9) == pytest.approx([5.0] * 20)  # bias-corrected: no pull towards 0 at the start
    smoothed = ema([0.0, 10.0] * 50, 0.9)
    assert max(smoothed[-10:]) - min(smoothed[-10:]) < 2.0
    with pytest.raises(ValueError, match="smoothing"):
        ema([1.0], 1.0)


def test_bad_run_directories_name_the_path_and_line(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="no such run directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match=r"empty/metrics\.jsonl: not found"):
        load_run(tmp_path / "empty")
    bad = make_run(tmp_path, "bad")
    with (bad / "metrics.jsonl").open("a") as f:
        f.write('{"step": 51, "loss/mean": 3.1}\n{"step": 52, "loss/mean": \n{"step": 53}\n')
    with pytest.raises(RunError, match=r"bad/metrics\.jsonl: line 53: not valid JSON"):
        load_run(bad)
    # a live run's last line, caught half written, is skipped rather than refused
    live = make_run(tmp_path, "live")
    with (live / "metrics.jsonl").open("a") as f:
        f.write('{"step": 51, "loss/me')
    assert load_run(live).records[-1]["step"] == 50


def test_plot_writes_png_for_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make_run(tmp_path, "run-a"), make_run(tmp_path, "run-b", steps=40, seed=2.1)
    out = tmp_path / "figs" / "curves.png"
    args = [str(a), str(b), "--metric", "loss/mean", "--metric", "optim/grad_norm/*", "-o", str(out)]
    assert plot_main([*args, "--smoothing", "0.8"]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 30_000  # 5 subplots of curves, not a blank canvas
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 1000 and height > 600
    assert "5 metric(s) of 2 run(s)" in capsys.readouterr().out
    assert plot_main([str(a), "-o", str(tmp_path / "default.png")]) == 0  # loss/mean by default


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{a}", "-m", "loss/mean", "--metric", "val/*/nope@*", "-o", "{out}"], "no metric matches 'val/*/nope@*'"),
        (["{a}", "{root}/no-such-run", "-o", "{out}"], "no-such-run: no such run directory"),
        (["{a}", "-o", "{out}", "--smoothing", "1.5"], "smoothing must be in [0, 1)"),
        (["{a}", "-o", "{root}/curves.gif"], "output suffix must be one of"),
        (["{a}"], "required: -o/--output"),
    ],
)
def test_plot_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    a = make_run(tmp_path, "a")
    out = tmp_path / "curves.png"
    argv = [s.format(a=a, out=out, root=tmp_path) for s in args]
    assert plot_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_report_is_self_contained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path, "a")
    out = tmp_path / "report.html"
    assert report_main([str(run), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.IGNORECASE)
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?https?://", page, re.IGNORECASE)
    assert not re.search(r"<(img|iframe)[^>]*\bsrc\s*=\s*[\"']?https?://", page, re.IGNORECASE)
    assert page.count("* plotly.js v") == 1  # the library is embedded once, however many panels there are
    for panel in PANEL_IDS:
        assert f'id="{panel}"' in page
    assert "124M (124,439,808)" in page and "best val loss" in page
    assert f"output_dir = &quot;{run}&quot;" in page  # the config, escaped
    # the flagged steps, listed without replaying them (no --spikes)
    spikes = re.search(r'<div id="spikes">(.*?)</table>', page)
    assert spikes is not None and "2 flagged steps" in spikes.group(1)
    assert "<td>23</td><td>loss</td>" in spikes.group(1) and "<td>31</td><td>gradient norm</td>" in spikes.group(1)
    # a run without MoE or validation metrics has no such panels
    plain = make_run(tmp_path, "plain")
    records = [
        {k: v for k, v in r.items() if not k.startswith(("val/", "max_vio", "routing", "expert_load"))}
        for r in map(json.loads, (plain / "metrics.jsonl").read_text().splitlines())
    ]
    (plain / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = render_report(load_run(plain))
    assert 'id="panel-loss"' in page and 'id="panel-val"' not in page and 'id="panel-moe"' not in page
    assert report_main([str(tmp_path / "nope"), "-o", str(out)]) == 2
    assert "no such run directory" in capsys.readouterr().err


def require_browser() -> None:
    """Skip when Chromium or Playwright is missing; under CI (which installs both) fail instead."""
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install playwright)")
    if missing:
        reason = "the browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is expected to install them")
        pytest.skip(reason)


@pytest.mark.timeout(120)
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    require_browser()
    from playwright.sync_api import sync_playwright

    report = tmp_path / "report.html"
    assert report_main([str(make_run(tmp_path, "a")), "-o", str(report)]) == 0
    errors: list[str] = []
    requests: list[str] = []
    started = time.perf_counter()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report.as_uri(), wait_until="load")
            for panel in PANEL_IDS:
                page.wait_for_selector(f"#{panel} .js-plotly-plot .main-svg", timeout=30_000)
            # traces drawn per panel, over its charts
            traces = page.evaluate(
                """ids => Object.fromEntries(ids.map(id => [id, Array.from(
                    document.querySelectorAll('#' + id + ' .js-plotly-plot'), g => g.data.length
                ).reduce((a, b) => a + b, 0)]))""",
                list(PANEL_IDS),
            )
            lines = page.locator("#panel-loss .scatterlayer .trace").count()
            # every chart is sized to its cell of the panel's grid, not drawn past it into its neighbour
            overflow = page.evaluate(
                """() => Array.from(document.querySelectorAll('.chart'), c => [c.querySelector('.js-plotly-plot').id,
                    c.querySelector('.main-svg').getBoundingClientRect().width - c.getBoundingClientRect().width])
                    .filter(([, excess]) => excess > 1)"""
            )
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    elapsed = time.perf_counter() - started
    assert not errors, errors
    assert not overflow, overflow
    assert all(url.startswith(("file:", "data:", "blob:", "about:")) for url in requests), requests
    # loss: raw, EMA and the spike marker; learning rate: the total and one line per group
    assert traces["panel-loss"] == 3 and traces["panel-lr"] == 1 + len(GROUPS) and lines == 3
    assert traces["panel-grad-norm"] == 1 + len(GROUPS) + 1
    assert all(n > 0 for n in traces.values()), traces
    shot = tmp_path / "report.png"
    assert shot.exists() and shot.stat().st_size > 50_000
    print(f"browser: {elapsed:.1f} s")


SCRIPT = "<script>window.__pwned = 1</script>"
ATTRIBUTE = '"><img src=x onerror="window.__pwned=2">'


@pytest.mark.timeout(120)
def test_report_shows_markup_from_configs_and_metrics_as_text(tmp_path: Path) -> None:
    """Run name, W&B name and tags, and metric names holding HTML stay text in the page: nothing in them runs."""
    require_browser()
    from playwright.sync_api import sync_playwright

    run = make_run(tmp_path, ATTRIBUTE)  # a folder name may hold all of it but the `/` of a closing tag
    config = CONFIG.replace('"{out}"', json.dumps(str(run)))  # JSON strings are TOML strings, quotes escaped
    config += f'\n[wandb]\nproject = "p"\nname = "{SCRIPT}"\ngroup = {json.dumps(ATTRIBUTE)}\n'
    config += f"tags = [{json.dumps(SCRIPT)}, {json.dumps(ATTRIBUTE)}]\n"
    (run / "config.toml").write_text(config, encoding="utf-8")
    with (run / "metrics.jsonl").open("a", encoding="utf-8") as f:
        # one drawn in the validation charts' legends, one listed as logged but not plotted
        f.write(json.dumps({"step": 51, f"val/{ATTRIBUTE}/loss@64": 3.0, SCRIPT: 1.0}) + "\n")
    report = tmp_path / "report.html"
    assert report_main([str(run), "-o", str(report)]) == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(report.as_uri(), wait_until="load")
            page.wait_for_selector("#panel-val .js-plotly-plot .main-svg", timeout=30_000)
            page.wait_for_timeout(500)  # an injected image would have failed to load and fired onerror by now
            pwned = page.evaluate("() => typeof window.__pwned")
            injected = page.evaluate("() => document.querySelectorAll('img, #run-config script').length")
            title = page.title()
            summary = page.inner_text("#run-summary")
            config = page.inner_text("#run-config")
            note = page.inner_text("#unplotted")
            legends = page.inner_text("#panel-val")
        finally:
            browser.close()
    assert pwned == "undefined" and injected == 0
    assert ATTRIBUTE in title and ATTRIBUTE in summary
    assert f'name = "{SCRIPT}"' in config and f"group = {json.dumps(ATTRIBUTE)}" in config
    assert SCRIPT in note
    assert "val/" in legends and "onerror" in legends  # plotly draws the name as SVG text
