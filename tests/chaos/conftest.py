"""Print the random-kill trials' tally at the end of a session that ran them."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Trials run, how many reached their kill, failures, and the seed that replays them."""
    from tests.chaos.test_random_kills import RESULTS

    if not RESULTS:
        return
    failed = [r for r in RESULTS if r["problems"]]
    reached = sum(bool(r["reached"]) for r in RESULTS)
    points: dict[str, int] = {}
    for r in RESULTS:
        points[str(r["point"])] = points.get(str(r["point"]), 0) + 1
    terminalreporter.write_line(
        f"chaos: {len(RESULTS)} trials (seed {RESULTS[0]['seed']}), {reached} reached their kill, "
        f"{len(RESULTS) - reached} did not, {len(failed)} failed; points: {points}"
    )
    for r in RESULTS:
        if not r["reached"]:
            terminalreporter.write_line(f"chaos: trial {r['index']} never reached its kill: {r}")
    for r in failed:
        terminalreporter.write_line(f"chaos: trial {r['index']} failed: {r}")
