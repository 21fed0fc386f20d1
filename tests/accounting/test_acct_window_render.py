"""Date words, output formats and charts."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime

import pytest

from accounting.charts import gpu_hours_png, usage_png, wait_png
from accounting.fairshare import fairshare_report
from accounting.render import duration, fairshare_text, usage_text
from accounting.usage import usage_report
from accounting.window import AccountingError, Window, make_window, parse_when
from gateway.slurm import records as rec
from tests.accounting.conftest import ACCT_DATA, RECORDED_AT, sacct
from tests.accounting.test_acct_usage import HOUR

NOW = datetime(2026, 11, 30, 12, 30, tzinfo=UTC)


@pytest.mark.parametrize(("word", "expected"), [
    ("now", NOW), ("today", datetime(2026, 11, 30, tzinfo=UTC)),
    ("-7d", datetime(2026, 11, 23, 12, 30, tzinfo=UTC)), ("-90m", datetime(2026, 11, 30, 11, tzinfo=UTC)),
    ("2026-11-29", datetime(2026, 11, 29, tzinfo=UTC)),
    ("2026-11-29T23:59", datetime(2026, 11, 29, 23, 59, tzinfo=UTC)),
    ("2026-11-30T01:00+01:00", datetime(2026, 11, 30, 0, 0, tzinfo=UTC)),
])
def test_date_words(word: str, expected: datetime) -> None:
    assert parse_when(word, now=NOW) == expected


@pytest.mark.parametrize("bad", ["2026-13-01", "yesterday", "7d", "-7w", ""])
def test_bad_dates_say_what_is_accepted(bad: str) -> None:
    with pytest.raises(AccountingError, match="--start .* is not a date: use YYYY-MM-DD"):
        make_window(bad, "now", now=NOW)


def test_empty_window_refused() -> None:
    with pytest.raises(AccountingError, match="--end .* must be after --start"):
        make_window("now", "-1d", now=NOW)


def test_window_days() -> None:
    w = Window(datetime(2026, 11, 29, 23, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC))
    assert [d.isoformat() for d in w.days()] == ["2026-11-29", "2026-11-30"]


def test_formats_agree() -> None:
    report = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    table = usage_text(report, "table")
    assert "t-acct-a" in table and "106.0" in table and "not available" in table
    rows = list(csv.DictReader(io.StringIO(usage_text(report, "csv"))))
    assert [r["key"] for r in rows] == ["t-acct-a", "t-acct-b", "TOTAL"]
    assert float(rows[0]["gpu_seconds"]) == 106 and rows[2]["requeues"] == "2"
    assert rows[0]["cancellations"] == ""  # not available, not zero
    data = json.loads(usage_text(report, "json"))
    assert data["rows"][1]["gpu_seconds"] == 47 and data["total"]["jobs"] == 11
    assert data["rows"][0]["states"] == {"COMPLETED": 5, "REQUEUED": 1}     # numbers, not a string (issue 35)
    assert data["rows"][0]["cancellations"] is None
    with pytest.raises(AccountingError, match="valid: table, csv, json"):
        usage_text(report, "yaml")


def test_fairshare_formats() -> None:
    usage = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    shares = rec.parse_sshare((ACCT_DATA / "sshare_tenants.txt").read_text())
    fs = fairshare_report(shares, usage, tenants=["t-acct-a", "t-acct-b"])
    table = fairshare_text(fs, "table")
    assert "Jain's fairness index" in table and "50.0%" in table
    data = json.loads(fairshare_text(fs, "json"))
    assert data["jain_index"] == pytest.approx(fs.jain_index)
    assert len(list(csv.DictReader(io.StringIO(fairshare_text(fs, "csv"))))) == 2


@pytest.mark.parametrize(("s", "text"), [(None, "-"), (4.4, "4s"), (75, "1m15s"), (7322, "2h02m")])
def test_duration(s: float | None, text: str) -> None:
    assert duration(s) == text


def test_charts_are_png() -> None:
    report = usage_report(sacct("sacct_midnight.txt"),
                          Window(datetime(2026, 11, 28, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)),
                          now=RECORDED_AT)
    for png in (usage_png(report), gpu_hours_png(report), wait_png(report)):
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    empty = usage_report([], HOUR, now=RECORDED_AT)
    assert usage_png(empty).startswith(b"\x89PNG")


def test_charts_do_not_mislead() -> None:
    """Issue 35: 20 tenants get 20 colours (tab10 repeated from the 11th), the legend sits beside the
    bars (it covered them), and the wait histogram counts runs in whole numbers (it showed 0.5 runs)."""
    from dataclasses import replace

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from accounting.charts import _gpu_hours_axes, _wait_axes, tenant_colour

    assert len({tenant_colour(i) for i in range(20)}) == 20
    report = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    day = next(iter(next(iter(report.gpu_hours_by_tenant_day.values()))))
    many = replace(report, gpu_hours_by_tenant_day={f"tenant-{i:02d}": {day: 1.0 + i} for i in range(15)})
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    _gpu_hours_axes(ax, many)
    fig.tight_layout()
    FigureCanvasAgg(fig).draw()
    legend = ax.get_legend()
    assert legend is not None and legend.get_window_extent().x0 >= ax.get_window_extent().x1
    colours = {tuple(p.get_facecolor()) for p in ax.patches}
    assert len(colours) == 15
    fig2 = Figure()
    ax2 = fig2.add_subplot()
    _wait_axes(ax2, (3.0, 5.0, 40.0))
    FigureCanvasAgg(fig2).draw()
    assert all(float(t).is_integer() for t in ax2.get_yticks())
