"""PNG charts of a usage report (matplotlib, Agg): for ``--plot`` and the portal's admin pages.

Figures are built with ``matplotlib.figure.Figure`` and an Agg canvas, never
pyplot: no global state, so a web worker can render concurrently.
"""

from __future__ import annotations

import io

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from accounting.usage import UsageReport, percentile


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _gpu_hours_axes(ax, report: UsageReport) -> None:  # type: ignore[no-untyped-def]
    days = report.window.days()
    labels = [d.isoformat() for d in days]
    bottom = [0.0] * len(days)
    for i, (tenant, per_day) in enumerate(report.gpu_hours_by_tenant_day.items()):
        values = [per_day.get(day, 0.0) for day in labels]
        ax.bar(labels, values, bottom=bottom, label=tenant, color=tenant_colour(i))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("GPU-hours per tenant per day (UTC)")
    ax.set_ylabel("GPU-hours")
    if report.gpu_hours_by_tenant_day:
        # beside the bars, never over them (issue 35), in as many columns as 20 tenants need
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  ncols=1 + (len(report.gpu_hours_by_tenant_day) - 1) // 12)
    else:
        ax.text(0.5, 0.5, "no GPU usage in this window", ha="center", va="center",
                transform=ax.transAxes)
    ax.tick_params(axis="x", labelrotation=45 if len(days) > 7 else 0, labelsize="small")


def tenant_colour(i: int) -> tuple[float, float, float, float]:
    """The ``i``-th tenant's colour: matplotlib's tab20 (20 categorical colours), so no two of 20
    tenants share one (tab10, the default cycle, repeats from the 11th)."""
    return tuple(colormaps["tab20"](i % 20))  # type: ignore[return-value]


def _wait_axes(ax, waits: tuple[float, ...]) -> None:  # type: ignore[no-untyped-def]
    ax.set_title(f"Queue wait (Start - Submit), {len(waits)} runs")
    ax.set_xlabel("seconds")
    ax.set_ylabel("runs")
    if not waits:
        ax.text(0.5, 0.5, "no job started in this window", ha="center", va="center",
                transform=ax.transAxes)
        return
    ax.hist(waits, bins=min(30, max(5, len(waits) // 2)), color="tab:gray")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))      # runs are counted: whole numbers
    ax.set_xlim(left=0)
    for q, style in ((50, "--"), (95, ":")):
        v = percentile(waits, q)
        if v is not None:
            ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} = {v:.0f}s")
    ax.legend(fontsize="small")


def gpu_hours_png(report: UsageReport) -> bytes:
    """PNG bytes: stacked bars of GPU-hours per tenant per UTC day of the window."""
    fig = Figure(figsize=(8, 4))
    _gpu_hours_axes(fig.add_subplot(), report)
    fig.tight_layout()
    return _png(fig)


def wait_png(report: UsageReport) -> bytes:
    """PNG bytes: histogram of queue waits with p50/p95 marked."""
    fig = Figure(figsize=(8, 4))
    _wait_axes(fig.add_subplot(), report.waits_s)
    fig.tight_layout()
    return _png(fig)


def usage_png(report: UsageReport) -> bytes:
    """PNG bytes: both charts, one above the other (what ``--plot`` writes)."""
    fig = Figure(figsize=(9, 8))
    top, bottom = fig.subplots(2, 1)
    _gpu_hours_axes(top, report)
    _wait_axes(bottom, report.waits_s)
    fig.tight_layout()
    return _png(fig)
