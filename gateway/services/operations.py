"""What a site's monitoring reads: job counts by tenant, state and phase, and the running jobs'
pace and ages, from the database at scrape time (``gateway.api.metrics`` exports them)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gateway.models import FineTuningJob, Tenant
from gateway.state import JobState


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    tenant: str
    tokens_per_s: float | None
    step_age_s: float | None          # since the gateway last read a line from the job
    checkpoint_age_s: float | None    # since the gateway saw its newest checkpoint


def job_counts(session: Session) -> list[tuple[str, str, str, int]]:
    """(tenant, status, phase, jobs) for every combination that has jobs."""
    rows = session.exec(select(Tenant.name, FineTuningJob.status, FineTuningJob.phase, sa.func.count())
                        .join(Tenant, col(Tenant.id) == col(FineTuningJob.tenant_id))
                        .group_by(col(Tenant.name), col(FineTuningJob.status), col(FineTuningJob.phase)))
    return [(t, s, p or "", int(n)) for t, s, p, n in rows]


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def running_jobs(session: Session, now: float | None = None) -> list[RunningJob]:
    """The running jobs with their last reported tokens/s and how old their last line and checkpoint are."""
    now = time.time() if now is None else now
    out = []
    rows = session.exec(select(FineTuningJob, Tenant.name).join(Tenant, col(Tenant.id) == col(FineTuningJob.tenant_id))
                        .where(FineTuningJob.status == JobState.RUNNING.value))
    for job, tenant in rows:
        p = job.progress or {}
        seen = _num(p.get("seen_at"))
        ck = p.get("checkpoint_at")
        ck_at = _num(ck[0]) if isinstance(ck, list) and ck else None
        out.append(RunningJob(job.id, tenant, _num(p.get("tokens_per_s")),
                              round(now - seen, 3) if seen else None, round(now - ck_at, 3) if ck_at else None))
    return out
