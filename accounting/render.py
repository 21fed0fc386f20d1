"""Reports as text: an aligned table, CSV or JSON (pure functions returning strings)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

from accounting.fairshare import FairshareReport
from accounting.usage import UsageReport, UsageRow
from accounting.window import AccountingError

FORMATS = ("table", "csv", "json")


def check_format(fmt: str) -> str:
    """Return ``fmt`` when it is one of FORMATS; raise AccountingError otherwise."""
    if fmt not in FORMATS:
        raise AccountingError(f"--format {fmt!r} is not a format; valid: {', '.join(FORMATS)}")
    return fmt


def duration(seconds: float | None) -> str:
    """``75`` → ``1m15s``; ``None`` → ``-`` (not measured)."""
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def usage_dicts(report: UsageReport, flat: bool = True) -> list[dict[str, Any]]:
    """One dict per group (TOTAL last): what CSV rows (``flat``: ``states`` as ``COMPLETED=2
    FAILED=1``) and JSON rows (``states`` an object of counts) hold."""
    return [_usage_dict(r, flat) for r in (*report.rows, report.total)]


def _usage_dict(r: UsageRow, flat: bool = True) -> dict[str, Any]:
    return {
        "key": r.key, "gpu_seconds": _num(r.gpu_seconds, 3), "gpu_hours": _num(r.gpu_hours, 6),
        "cpu_seconds": _num(r.cpu_seconds, 3), "cpu_hours": _num(r.cpu_hours, 6), "jobs": r.jobs,
        "states": " ".join(f"{k}={v}" for k, v in r.states.items()) if flat else dict(r.states),
        "waits": r.waits, "wait_p50_s": _num(r.wait_p50_s, 3), "wait_p95_s": _num(r.wait_p95_s, 3),
        "run_p50_s": _num(r.run_p50_s, 3), "run_p95_s": _num(r.run_p95_s, 3), "requeues": r.requeues,
        "cancellations": r.cancellations, "cancel_stop_p50_s": _num(r.cancel_stop_p50_s, 3),
        "cancel_stop_p95_s": _num(r.cancel_stop_p95_s, 3), "scrub_failures": r.scrub_failures,
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 or i == len(widths) - 1 else f"{{:>{w}}}"
                    for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r).rstrip() for r in (header, *rows))


def _opt(v: int | None) -> str:
    return "n/a" if v is None else str(v)


def _window_line(report: UsageReport | FairshareReport) -> str:
    w = report.window
    return f"window {w.start.isoformat()} .. {w.end.isoformat()} (UTC)"


def usage_text(report: UsageReport, fmt: str) -> str:
    """The usage report in ``fmt`` (table, csv or json)."""
    check_format(fmt)
    dicts = usage_dicts(report, flat=fmt != "json")
    if fmt == "json":
        return json.dumps({
            "window": {"start": report.window.start.isoformat(), "end": report.window.end.isoformat()},
            "by": report.by, "generated_at": report.generated_at.isoformat(), "rows": dicts[:-1],
            "total": dicts[-1], "gpu_hours_by_tenant_day": report.gpu_hours_by_tenant_day,
            "note": report.note, "skipped_records": list(report.skipped),
        }, indent=2)
    if fmt == "csv":
        return _csv(dicts)
    header = (report.by.upper(), "GPU-h", "GPU-s", "CPU-h", "JOBS", "WAIT p50/p95", "RUN p50/p95",
              "REQUEUES", "CANCELS (stop p50/p95)", "SCRUB FAIL", "STATES")
    body = [(r.key, f"{r.gpu_hours:.3f}", f"{r.gpu_seconds:.1f}", f"{r.cpu_hours:.3f}", str(r.jobs),
             f"{duration(r.wait_p50_s)}/{duration(r.wait_p95_s)}",
             f"{duration(r.run_p50_s)}/{duration(r.run_p95_s)}", str(r.requeues),
             "n/a" if r.cancellations is None else
             f"{r.cancellations} ({duration(r.cancel_stop_p50_s)}/{duration(r.cancel_stop_p95_s)})",
             _opt(r.scrub_failures), " ".join(f"{k}={v}" for k, v in r.states.items()) or "-")
            for r in (*report.rows, report.total)]
    lines = [_window_line(report), _table(header, body)]
    if report.note:
        lines.append(f"note: {report.note}")
    lines += [f"flagged: a sacct record skipped, not counted: {s}" for s in report.skipped]
    return "\n".join(lines)


def _csv(dicts: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if dicts:
        w = csv.DictWriter(buf, fieldnames=list(dicts[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(dicts)
    return buf.getvalue().rstrip("\n")


def fairshare_dicts(report: FairshareReport) -> list[dict[str, Any]]:
    """One flat dict per tenant row (what CSV and JSON rows hold); shares and ratio rounded to 6 digits."""
    return [{
        "tenant": r.tenant, "raw_shares": r.raw_shares, "norm_shares": r.norm_shares,
        "raw_usage": r.raw_usage, "effective_usage": r.effective_usage, "fairshare": r.fairshare,
        "level_fs": r.level_fs, "jobs": r.jobs, "gpu_seconds": _num(r.gpu_seconds, 3),
        "entitled_share": _num(r.entitled_share, 6), "usage_share": _num(r.usage_share, 6),
        "usage_over_entitled": _num(r.ratio, 6), "active": r.tenant in report.active,
    } for r in report.rows]


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fairshare_text(report: FairshareReport, fmt: str) -> str:
    """The fairshare report in ``fmt`` (table, csv or json)."""
    check_format(fmt)
    dicts = fairshare_dicts(report)
    if fmt == "json":
        return json.dumps({
            "window": {"start": report.window.start.isoformat(), "end": report.window.end.isoformat()},
            "generated_at": report.generated_at.isoformat(), "rows": dicts,
            "active_tenants": list(report.active), "jain_index": report.jain_index,
        }, indent=2)
    if fmt == "csv":
        return _csv(dicts)
    header = ("TENANT", "SHARES", "NORM", "EFF.USAGE", "FAIRSHARE", "JOBS", "GPU-h",
              "ENTITLED", "USED", "USED/ENTITLED")
    body = [(r.tenant, _opt(r.raw_shares), _f(r.norm_shares), _f(r.effective_usage), _f(r.fairshare),
             str(r.jobs), f"{r.gpu_seconds / 3600:.3f}", _pct(r.entitled_share), _pct(r.usage_share),
             _f(r.ratio, 2)) for r in report.rows]
    jain = "-" if report.jain_index is None else f"{report.jain_index:.3f}"
    return "\n".join([
        _window_line(report), _table(header, body),
        f"Jain's fairness index of usage/entitled over {len(report.active)} active tenant(s): {jain} "
        "(1 = every active tenant got GPU time in proportion to its shares)",
    ])


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"
