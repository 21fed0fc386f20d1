"""Facts only the gateway knows: cancellations (with their stop latency) and scrub failures.

Read from the gateway's database (``fine_tuning_jobs``): a cancellation is a job with a
``cancel_requested_at`` in the window (and ``stop_confirmed_at`` once Slurm confirmed no
process was left); a scrub failure is a job whose node cleanup the epilog reported failed
(``cleanup = 'failed'``; the node drained). When the database cannot be read (another host,
no permission) ``load_gateway_facts`` returns None and reports say "not available" instead
of a misleading zero. Read-only: one query per kind of fact over the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from accounting.window import Window
from gateway.state import Cleanup

NOT_AVAILABLE = ("gateway DB not available here (missing or unreadable): cancellations and scrub failures "
                 "are not reported")


@dataclass(frozen=True)
class Cancellation:
    job_id: int                 # Slurm job id (JobIDRaw)
    tenant: str
    requested_at: datetime      # the tenant's cancel request reached the gateway
    stopped_at: datetime | None  # Slurm confirmed no process left; None while still stopping
    qos: str | None = None      # the QOS the gateway submitted it under (groups it --by qos without sacct)

    @property
    def stop_latency_s(self) -> float | None:
        """Seconds from the cancel request to Slurm's confirmation; None while still stopping."""
        if self.stopped_at is None:
            return None
        return (self.stopped_at - self.requested_at).total_seconds()


@dataclass(frozen=True)
class ScrubFailure:
    job_id: int | None
    tenant: str | None
    node: str
    at: datetime
    reason: str
    qos: str | None = None


@dataclass(frozen=True)
class GatewayFacts:
    cancellations: tuple[Cancellation, ...] = ()
    scrub_failures: tuple[ScrubFailure, ...] = ()
    # Slurm job id -> (tenant, who submitted it): the gateway's own record (``created_by``)
    submitters: dict[int, tuple[str, str]] = field(default_factory=dict)

    def submitter(self, slurm_job_id: int, account: str | None) -> str | None:
        """Who submitted Slurm job ``slurm_job_id`` through the gateway (a person's username, or
        ``token:<name>``); None when the gateway did not submit it for that tenant's account."""
        tenant, who = self.submitters.get(slurm_job_id, (None, None))
        return who if tenant is not None and tenant == account else None


def load_gateway_facts(database_url: str, window: Window) -> GatewayFacts | None:
    """Cancellations and scrub failures in ``window`` from the gateway DB; None if it cannot be
    read (the report then says so)."""
    import sqlalchemy as sa
    from sqlmodel import Session, col, select

    from gateway.db import make_engine  # lazy: the DB layer (~0.3 s); `finetune` imports this at start
    from gateway.models import FineTuningJob, Tenant  # lazy: the DB layer, as above

    if database_url.startswith("sqlite:///"):
        from pathlib import Path

        if not Path(database_url.split("///", 1)[1]).is_file():   # never create one to report on
            return None
    try:
        engine = make_engine(database_url)
    except (OSError, sa.exc.SQLAlchemyError, RuntimeError):
        return None
    try:
        with Session(engine) as s:
            names = {t.id: t.name for t in s.exec(select(Tenant))}
            cancelled = s.exec(select(FineTuningJob).where(
                col(FineTuningJob.cancel_requested_at) >= window.start,
                col(FineTuningJob.cancel_requested_at) < window.end,
                col(FineTuningJob.slurm_job_id).is_not(None)))
            cancellations = tuple(Cancellation(int(j.slurm_job_id or 0), names.get(j.tenant_id, "?"),
                                               j.cancel_requested_at, j.stop_confirmed_at, j.qos)
                                  for j in cancelled if j.cancel_requested_at is not None)
            failed = s.exec(select(FineTuningJob).where(
                FineTuningJob.cleanup == Cleanup.FAILED, col(FineTuningJob.finished_at) >= window.start,
                col(FineTuningJob.finished_at) < window.end))
            scrubs = tuple(ScrubFailure(j.slurm_job_id, names.get(j.tenant_id), str((j.progress or {}).get("node")),
                                        j.finished_at, "the epilog's scrub failed; the node was drained", j.qos)
                           for j in failed if j.finished_at is not None)
            made = s.exec(select(FineTuningJob.slurm_job_id, FineTuningJob.tenant_id, FineTuningJob.created_by).where(
                col(FineTuningJob.slurm_job_id).is_not(None), col(FineTuningJob.created_at) < window.end))
            submitters = {int(sid or 0): (names.get(tid, "?"), by or "(before persons)") for sid, tid, by in made}
    except (OSError, sa.exc.SQLAlchemyError):
        return None
    finally:
        engine.dispose()
    return GatewayFacts(cancellations, scrubs, submitters)
