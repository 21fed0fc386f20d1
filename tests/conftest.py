"""Test tiers: every test module is marked with its tier (see pyproject markers).

Unmarked tests in tests/unit are marked ``unit`` automatically.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {"unit", "train", "slurm", "ssh", "gpu", "service", "browser", "hostile", "local"}
    slow_selected = "slow" in (config.getoption("markexpr") or "")
    for item in items:
        if not any(m.name in tiers for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)
        if "slow" in item.keywords and not slow_selected:   # scripts/test.sh selects them
            item.add_marker(pytest.mark.skip(reason="slow test: select it with `-m slow`"))


@pytest.fixture
def data_dir() -> Path:
    return DATA


TIERS = ("unit", "train", "slurm", "ssh", "service", "browser", "hostile", "local", "gpu")


def _tier(report: pytest.TestReport) -> str:
    keywords = report.keywords
    return next((t for t in reversed(TIERS) if t in keywords), "unit")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """Say loudly, per tier, what ran and what was skipped and why."""
    counts: dict[str, dict[str, int]] = {}
    reasons: dict[str, set[str]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if not hasattr(rep, "keywords") or (outcome == "passed" and rep.when != "call"):
                continue
            tier = _tier(rep)
            counts.setdefault(tier, {}).setdefault(outcome, 0)
            counts[tier][outcome] += 1
            if outcome == "skipped" and isinstance(rep.longrepr, tuple):
                reasons.setdefault(tier, set()).add(str(rep.longrepr[2]).removeprefix("Skipped: "))
    tr = terminalreporter
    tr.section("test tiers")
    for tier in TIERS:
        c = counts.get(tier)
        if not c:
            tr.write_line(f"{tier:<8} no tests collected in this tier")
            continue
        line = ", ".join(f"{n} {k}" for k, n in sorted(c.items()))
        tr.write_line(f"{tier:<8} {line}")
        for r in sorted(reasons.get(tier, ())):
            tr.write_line(f"{'':<8}   SKIPPED: {r}")
