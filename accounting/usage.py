"""The usage report: pure functions from sacct job rows to per-group figures.

Rules (each one says what a sysadmin would otherwise misread):

- GPU-seconds of a run = GPUs allocated (AllocTRES ``gres/gpu``) x ElapsedRaw.
  A run that spans the window edge (or a UTC midnight, for ``--by day``) is
  prorated by the part of its [Start, End) inside; a still-running job counts
  up to ``now``. CPU-seconds likewise from AllocTRES ``cpu``.
- A job is counted once, in its final state (the last non-REQUEUED row of
  ``sacct --duplicates``); every REQUEUED row is one requeue.
- Queue wait = Start - Submit of each run that started in the window; jobs that
  never got an allocation (cancelled while pending, still pending) have none.
- Run time = ElapsedRaw of each finished, non-requeued run that ended in the window.
- Days are UTC days.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from accounting.gateway_facts import NOT_AVAILABLE, GatewayFacts
from accounting.window import AccountingError, Window
from gateway.slurm.records import AcctRecord
from gateway.state import SlurmState
from gateway.storage.layout import unix_user_for

GROUPINGS = ("tenant", "user", "person", "qos", "day")
NOT_VIA_GATEWAY = "(not via the gateway)"
UNKNOWN = "(unknown)"


def tres_count(tres: str, name: str) -> int:
    """The count of one TRES (``cpu``) in ``cpu=4,gres/gpu=1,mem=1G`` → 4; 0 when absent."""
    m = re.search(rf"(?:^|,){re.escape(name)}=(\d+)", tres or "")
    return int(m.group(1)) if m else 0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_span(r: AcctRecord, now: datetime) -> tuple[datetime, datetime] | None:
    """[Start, End) of a run that got an allocation; End is ``now`` while it runs."""
    if not r.ran or r.start is None:
        return None
    end = r.end if r.end is not None else now
    return r.start, max(end, r.start)


def _midnights(lo: datetime, hi: datetime) -> Iterable[tuple[date, datetime, datetime]]:
    t = lo
    while t < hi:
        nxt = min(hi, datetime.combine(t.date() + timedelta(days=1), datetime.min.time(), UTC))
        yield t.date(), t, nxt
        t = nxt


def charged_pieces(r: AcctRecord, window: Window, now: datetime) -> list[tuple[date, float]]:
    """Seconds of ``r``'s run inside ``window``, per UTC day.

    A finished run wholly inside the window adds up to exactly ElapsedRaw (Slurm's
    whole-second measure); a partial one gets ElapsedRaw x overlap / (End - Start).
    """
    span = run_span(r, now)
    if span is None:
        return []
    start, end = span
    lo, hi = max(start, window.start), min(end, window.end)
    if hi <= lo:
        return []
    total = (end - start).total_seconds()
    scale = 1.0
    if r.end is not None and r.elapsed_s is not None and total > 0:
        scale = r.elapsed_s / total
    return [(d, (b - a).total_seconds() * scale) for d, a, b in _midnights(lo, hi)]


@dataclass(frozen=True)
class UsageRow:
    """One group's figures; ``None`` means "not measured", never zero."""

    key: str
    gpu_seconds: float
    cpu_seconds: float
    jobs: int
    states: dict[str, int]
    waits: int
    wait_p50_s: float | None
    wait_p95_s: float | None
    run_p50_s: float | None
    run_p95_s: float | None
    requeues: int
    cancellations: int | None
    cancel_stop_p50_s: float | None
    cancel_stop_p95_s: float | None
    scrub_failures: int | None

    @property
    def gpu_hours(self) -> float:
        """``gpu_seconds`` in hours."""
        return self.gpu_seconds / 3600

    @property
    def cpu_hours(self) -> float:
        """``cpu_seconds`` in hours."""
        return self.cpu_seconds / 3600


@dataclass
class _Acc:
    gpu_s: float = 0.0
    cpu_s: float = 0.0
    states: Counter[str] = field(default_factory=Counter)
    waits: list[float] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)
    requeues: int = 0
    cancels: list[float | None] = field(default_factory=list)
    scrubs: int = 0

    def row(self, key: str, facts: GatewayFacts | None) -> UsageRow:
        stops = [s for s in self.cancels if s is not None]
        return UsageRow(
            key=key, gpu_seconds=self.gpu_s, cpu_seconds=self.cpu_s,
            jobs=sum(self.states.values()), states=dict(sorted(self.states.items())),
            waits=len(self.waits), wait_p50_s=percentile(self.waits, 50),
            wait_p95_s=percentile(self.waits, 95),
            run_p50_s=percentile(self.runs, 50), run_p95_s=percentile(self.runs, 95),
            requeues=self.requeues,
            cancellations=None if facts is None else len(self.cancels),
            cancel_stop_p50_s=percentile(stops, 50), cancel_stop_p95_s=percentile(stops, 95),
            scrub_failures=None if facts is None else self.scrubs,
        )


@dataclass(frozen=True)
class UsageReport:
    window: Window
    by: str
    generated_at: datetime
    rows: tuple[UsageRow, ...]
    total: UsageRow
    gpu_hours_by_tenant_day: dict[str, dict[str, float]]  # for the chart: tenant → UTC day → hours
    waits_s: tuple[float, ...]                             # every queue wait, for the chart
    note: str | None                                       # what could not be reported, and why
    skipped: tuple[str, ...] = ()                          # sacct records that did not parse: flagged, not counted


def _group_key(r: AcctRecord, by: str, facts: GatewayFacts | None = None) -> str:
    if by == "person":      # the gateway's record of who submitted the job, never a field Slurm carries
        if facts is None:
            return UNKNOWN
        return facts.submitter(r.job_id_raw, r.account) or NOT_VIA_GATEWAY
    value = {"tenant": r.account, "user": r.user, "qos": r.qos}[by]
    return value or UNKNOWN


def _unix_user(tenant: str | None) -> str | None:
    """The unix user a tenant's jobs run as (what sacct's User holds), None for no valid tenant."""
    try:
        return unix_user_for(tenant) if tenant else None
    except ValueError:
        return None


def final_runs(records: Iterable[AcctRecord]) -> list[AcctRecord]:
    """One row per job: its last non-REQUEUED run (or its REQUEUED row while the rerun waits)."""
    by_job: dict[str, AcctRecord] = {}
    for r in records:
        have = by_job.get(r.job_id)
        if have is None or have.state == SlurmState.REQUEUED or r.state != SlurmState.REQUEUED:
            by_job[r.job_id] = r
    return list(by_job.values())


def _event_time(r: AcctRecord, now: datetime) -> datetime:
    return r.end or r.start or r.submit or now


def usage_report(records: Sequence[AcctRecord], window: Window, *, by: str = "tenant",
                 now: datetime | None = None, facts: GatewayFacts | None = None,
                 accounts: Sequence[str] | None = None) -> UsageReport:
    """Aggregate sacct rows (``sacct --duplicates``: every run) over ``window`` by ``by``.

    ``facts`` are the gateway DB's cancellations and scrub failures, or None where
    that DB is not available (the report then says so); ``accounts``: the report is limited to
    these accounts (``records`` already are: the facts are filtered to them too). A fact whose job
    has no sacct row here is grouped by what the gateway knows of it (its tenant; for ``--by user``
    the tenant's unix user, for ``--by qos`` the QOS it was submitted under). Records the parser skipped
    (``records.skipped``, a ``Rows``) are flagged in ``skipped``, never counted. Raises
    AccountingError for an unknown ``by``.
    """
    if by not in GROUPINGS:
        raise AccountingError(f"--by {by!r} is not a grouping; valid: {', '.join(GROUPINGS)}")
    now = now or datetime.now(UTC)
    accs: dict[str, _Acc] = defaultdict(_Acc)
    total = _Acc()

    def key_at(r: AcctRecord | None, t: datetime, tenant: str | None = None, qos: str | None = None) -> str:
        if by == "day":
            return window.clamp(t).date().isoformat()
        if r is None:
            known = {"tenant": tenant, "user": _unix_user(tenant), "qos": qos}
            return known.get(by) or UNKNOWN
        return _group_key(r, by, facts)

    def both(key: str) -> tuple[_Acc, _Acc]:
        return accs[key], total

    tenant_day: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    waits: list[float] = []
    for r in records:
        gpus, cpus = r.gpus if r.ran else 0, tres_count(r.alloc_tres, "cpu")
        for day, secs in charged_pieces(r, window, now):
            for a in both(day.isoformat() if by == "day" else _group_key(r, by, facts)):
                a.gpu_s += gpus * secs
                a.cpu_s += cpus * secs
            tenant_day[r.account or UNKNOWN][day.isoformat()] += gpus * secs / 3600
        if r.wait_s is not None and r.start is not None and window.start <= r.start < window.end:
            waits.append(r.wait_s)
            for a in both(key_at(r, r.start)):
                a.waits.append(r.wait_s)
        if r.end is None or not window.start <= r.end < window.end:
            continue
        for a in both(key_at(r, r.end)):
            if r.state == SlurmState.REQUEUED:
                a.requeues += 1
            elif r.ran and r.elapsed_s is not None:
                a.runs.append(float(r.elapsed_s))
    for r in final_runs(records):
        for a in both(key_at(r, _event_time(r, now))):
            a.states[r.state] += 1
    _add_facts(facts, records, window, key_at, both, accounts)

    rows = tuple(accs[k].row(k, facts) for k in sorted(accs))
    return UsageReport(
        window=window, by=by, generated_at=now, rows=rows, total=total.row("TOTAL", facts),
        gpu_hours_by_tenant_day={t: dict(sorted(d.items())) for t, d in sorted(tenant_day.items())},
        waits_s=tuple(waits), note=NOT_AVAILABLE if facts is None else None,
        skipped=tuple(str(b) for b in getattr(records, "skipped", ())),
    )


def _add_facts(facts: GatewayFacts | None, records: Sequence[AcctRecord], window: Window,
               key_at: Callable[..., str], both: Callable[[str], tuple[_Acc, _Acc]],
               accounts: Sequence[str] | None = None) -> None:
    """Cancellations (by request time) and scrub failures (by report time) inside the window, of
    ``accounts``' jobs only when the report is limited to them (the gateway DB holds every tenant's)."""
    if facts is None:
        return
    by_id = {r.job_id_raw: r for r in records}
    for c in facts.cancellations:
        if window.start <= c.requested_at < window.end and (accounts is None or c.tenant in accounts):
            for a in both(key_at(by_id.get(c.job_id), c.requested_at, c.tenant, c.qos)):
                a.cancels.append(c.stop_latency_s)
    for f in facts.scrub_failures:
        if window.start <= f.at < window.end and (accounts is None or f.tenant in accounts):
            rec = by_id.get(f.job_id) if f.job_id is not None else None
            for a in both(key_at(rec, f.at, f.tenant, f.qos)):
                a.scrubs += 1
