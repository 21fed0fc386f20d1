"""Every write to a job row: the version-guarded UPDATE, the state change, the event log.

Every state change goes through ``apply_event``: ``state.transition`` plus an
UPDATE guarded by the row's ``version``, so two writers (a cancel and a
publication, a reconciler and a request) can never both win. Kept apart from the
job services that call it (create, control, progress, publication) so each of them
imports the one write path and nothing else of the others.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col

from gateway.models import FineTuningJob, JobEvent, utcnow
from gateway.services import webhooks
from gateway.state import TERMINAL, Event, JobState, transition


class StaleJob(Exception):
    """The job row changed under us (version mismatch): re-read and decide again."""


def apply_event(session: Session, job: FineTuningJob, event: Event, *, message: str | None = None,
                level: str = "info", **changes: Any) -> JobState:
    """Move ``job`` by ``event`` (IllegalTransition if not allowed), with ``changes``,
    in the caller's transaction. Raises StaleJob if another writer got there first."""
    before = JobState(job.status)
    new = transition(before, event)
    update_fields(session, job, status=new.value, **changes)
    add_event(session, job.id, message or f"Job {new.value.replace('_', ' ')}", level=level,
              data={"status": new.value})
    if new in TERMINAL and before not in TERMINAL:
        webhooks.enqueue(session, job, new)     # the outbox: in this transaction, or not at all
    return new


def update_fields(session: Session, job: FineTuningJob, **changes: Any) -> None:
    """Change ``job``'s row, bumping its version, only if nobody changed it since it was read."""
    values = {"version": job.version + 1, **changes}
    res = session.execute(sa.update(FineTuningJob)
                          .where(col(FineTuningJob.id) == job.id, col(FineTuningJob.version) == job.version)
                          .values(**values))
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleJob(job.id)
    for k, v in values.items():
        setattr(job, k, v)


def add_event(session: Session, job_id: str, message: str, *, level: str = "info",
              type_: str = "message", data: dict[str, Any] | None = None,
              created_at: datetime | None = None) -> None:
    """Add an event to the job's log in the caller's transaction (message cut to 1000 characters)."""
    session.add(JobEvent(job_id=job_id, message=message[:1000], level=level, type=type_, data=data,
                         created_at=created_at or utcnow()))
