"""Print the random-kill trials' tally at the end of a session that ran them."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Trials run, how many the kill hit, failures, and the seed that replays them."""
    from tests.chaos.test_random_kills import RESULTS

    if not RESULTS:
        return
    failed = [r for r in RESULTS if r["problems"]]
    killed = sum(bool(r["killed"]) for r in RESULTS)
    points: dict[str, int] = {}
    for r in RESULTS:
        points[str(r["point"])] = points.get(str(r["point"]), 0) + 1
    terminalreporter.write_line(
        f"chaos: {len(RESULTS)} trials (seed {RESULTS[0]['seed']}), {killed} killed the run before its end, "
        f"{len(failed)} failed; points: {points}"
    )
    for r in failed:
        terminalreporter.write_line(f"chaos: trial {r['index']} failed: {r}")
