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


def _item_tier(item: pytest.Item) -> str:
    """A test's tier: the highest-ranked tier marker it carries (by marker, not by keyword: a unit test
    under tests/browser/ has "browser" among its keywords)."""
    marks = {m.name for m in item.iter_markers()}
    return next((t for t in reversed(TIERS) if t in marks), "unit")


_TIER_OF = pytest.StashKey[dict[str, str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note each collected test's tier for the summary (a report carries keywords, not markers)."""
    session.config.stash[_TIER_OF] = {item.nodeid: _item_tier(item) for item in session.items}


def _tier(report: pytest.TestReport, tiers: dict[str, str]) -> str:
    if report.nodeid in tiers:
        return tiers[report.nodeid]
    keywords = report.keywords      # not a collected item (a collection error): its keywords
    return next((t for t in reversed(TIERS) if t in keywords), "unit")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 60 else f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """Say loudly, per tier, what ran and what was skipped and why, and what each tier cost: the summed
    setup, call and teardown time of its tests (the tiers do not overlap, so the sums add up to the run
    less collection)."""
    tiers = config.stash.get(_TIER_OF, {})
    counts: dict[str, dict[str, int]] = {}
    reasons: dict[str, set[str]] = {}
    seconds: dict[str, float] = {}
    for outcome in ("passed", "failed", "skipped", "error", "xfailed", "xpassed", ""):
        for rep in terminalreporter.stats.get(outcome, []):
            if not hasattr(rep, "keywords"):
                continue
            tier = _tier(rep, tiers)
            seconds[tier] = seconds.get(tier, 0.0) + getattr(rep, "duration", 0.0)
            if outcome == "" or (outcome == "passed" and rep.when != "call"):
                continue
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
        tr.write_line(f"{tier:<8} {line} in {_duration(seconds.get(tier, 0.0))}")
        for r in sorted(reasons.get(tier, ())):
            tr.write_line(f"{'':<8}   SKIPPED: {r}")
