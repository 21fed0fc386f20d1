"""``finetune admin report …``: the only accounting module that talks to Slurm (through the client)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import click

from accounting.fairshare import fairshare_report
from accounting.gateway_facts import load_gateway_facts
from accounting.render import FORMATS, check_format, fairshare_text, usage_text
from accounting.usage import GROUPINGS, UsageReport, usage_report
from accounting.window import DATE_HELP, AccountingError, Window, make_window
from gateway.config import get_settings
from gateway.errors import friendly_errors
from gateway.slurm import SlurmClient, make_runner


def _fetch_usage(window: Window, by: str, accounts: tuple[str, ...]) -> UsageReport:
    settings = get_settings()
    now = datetime.now(UTC)
    rows = SlurmClient(make_runner(settings)).sacct(window.start, window.end,
                                                    accounts=list(accounts) or None)
    facts = load_gateway_facts(settings.database_url, window)
    return usage_report(rows, window, by=by, now=now, facts=facts, accounts=list(accounts) or None)


def _window_options(fn):  # type: ignore[no-untyped-def]
    fn = click.option("--end", default="now", show_default=True, help=f"Window end: {DATE_HELP}.")(fn)
    fn = click.option("--start", default="-7d", show_default=True, help=f"Window start: {DATE_HELP}.")(fn)
    fn = click.option("--account", "accounts", multiple=True,
                      help="Only this tenant (repeatable); default: every tenant.")(fn)
    return click.option("--format", "fmt", default="table", show_default=True,
                        help=f"Output: {', '.join(FORMATS)}.")(fn)


def register(admin: click.Group) -> None:
    """Add ``report usage`` and ``report fairshare`` to the ``finetune admin`` group."""
    @admin.group("report")
    def report() -> None:
        """Usage and fairness reports from sacct/sshare."""

    @report.command("usage")
    @_window_options
    @click.option("--by", default="tenant", show_default=True, help=f"Group by: {', '.join(GROUPINGS)}.")
    @click.option("--plot", type=click.Path(dir_okay=False, writable=True),
                  help="Also write a PNG: GPU-hours per tenant per day, and the queue-wait distribution.")
    @friendly_errors
    def usage(start: str, end: str, accounts: tuple[str, ...], fmt: str, by: str,
              plot: str | None) -> None:
        """GPU/CPU-hours, jobs by final state, queue wait, run time and requeues, per group."""
        check_format(fmt)
        if by not in GROUPINGS:
            raise AccountingError(f"--by {by!r} is not a grouping; valid: {', '.join(GROUPINGS)}")
        rep = _fetch_usage(make_window(start, end), by, accounts)
        click.echo(usage_text(rep, fmt))
        if plot:
            from accounting.charts import usage_png  # lazy: matplotlib (~0.5 s), only for --plot

            Path(plot).write_bytes(usage_png(rep))
            click.echo(f"chart written to {plot}", err=True)

    @report.command("fairshare")
    @_window_options
    @friendly_errors
    def fairshare(start: str, end: str, accounts: tuple[str, ...], fmt: str) -> None:
        """Shares, sshare's fairshare factor, usage share vs entitled share, Jain's index."""
        check_format(fmt)
        rep = _fetch_usage(make_window(start, end), "tenant", accounts)
        shares = SlurmClient(make_runner()).sshare()
        fs = fairshare_report(shares, rep, tenants=accounts or None,
                              parent=get_settings().parent_account)
        click.echo(fairshare_text(fs, fmt))
