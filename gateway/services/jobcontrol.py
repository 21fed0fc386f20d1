"""Controlling a running job: cancel, pause and resume, each a state change first
(committed, retried on a version race) and then Slurm told through the reconciler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sqlmodel import Session

from gateway.access.tokens import Principal
from gateway.config import Settings
from gateway.errors import Conflict, SlurmError
from gateway.models import FineTuningJob, Tenant, utcnow
from gateway.services.jobreads import get_job
from gateway.services.jobwrites import StaleJob, apply_event
from gateway.state import ACTIVE, Event, JobState


def _retrying(session: Session, principal: Principal, job_id: str,
              change: Callable[[FineTuningJob], bool]) -> FineTuningJob:
    """Read the caller's job and apply ``change`` to it (True: it wrote, committed now); read and
    try again when another writer changed the row first (StaleJob). Conflict (``busy``) after 5."""
    for _ in range(5):
        job = get_job(session=session, principal=principal, job_id=job_id)
        try:
            if change(job):
                session.commit()
            return job
        except StaleJob:
            session.rollback()
            session.expire_all()
    raise Conflict(f"job {job_id} is changing state; retry", code="busy")


def request_cancel(*, session: Session, principal: Principal, job_id: str) -> FineTuningJob:
    """Mark the job cancelling at once (idempotent). Conflict (409) if it already finished."""
    def cancel(job: FineTuningJob) -> bool:
        state = JobState(job.status)
        if state is JobState.CANCELLING:
            return False
        if state not in ACTIVE:
            raise Conflict(f"job {job_id} already {state.value}: nothing to cancel", code="job_finished")
        apply_event(session, job, Event.CANCEL, message="Cancellation requested", cancel_requested_at=utcnow())
        if job.slurm_job_id is None:   # never reached Slurm: nothing to stop
            apply_event(session, job, Event.STOPPED, message="Job cancelled (it never reached Slurm)",
                        stop_confirmed_at=utcnow(), finished_at=utcnow())
        return True

    return _retrying(session, principal, job_id, cancel)


def _tenant_name(session: Session, job: FineTuningJob) -> str:
    """The name of ``job``'s tenant (whose Slurm account and user its Slurm job must have)."""
    tenant = session.get(Tenant, job.tenant_id)
    assert tenant is not None
    return tenant.name


class CancelStarter(Protocol):
    """What tells Slurm to stop a job (the reconciler: ``scancel`` in its own thread)."""

    def start_cancel(self, slurm_id: int | None, tenant: str) -> None:
        """Tell Slurm to stop ``tenant``'s job ``slurm_id`` without waiting (nothing when it is None)."""
        ...


def cancel_job(*, session: Session, principal: Principal, job_id: str,
               reconciler: CancelStarter | None) -> FineTuningJob:
    """``request_cancel`` (committed), then, while the job is cancelling and a reconciler runs,
    Slurm is told now; the job turns ``cancelled`` once Slurm confirms the stop. Raises as
    ``request_cancel`` does (NotFound, Conflict)."""
    job = request_cancel(session=session, principal=principal, job_id=job_id)
    if reconciler is not None and job.status == JobState.CANCELLING.value:
        reconciler.start_cancel(job.slurm_job_id, _tenant_name(session, job))
    return job


class PauseControl(Protocol):
    """What holds and releases a job in Slurm (the reconciler: ``scontrol hold``/``release``)."""

    def start_pause(self, slurm_id: int | None, tenant: str) -> None:
        """Hold ``tenant``'s job and make it checkpoint and leave its GPU, without waiting."""
        ...

    def release(self, slurm_id: int | None, tenant: str) -> None:
        """Release ``tenant``'s job's hold (SlurmError when Slurm refuses or it is not the tenant's)."""
        ...


def _change(session: Session, principal: Principal, job_id: str, event: Event, allowed: set[JobState],
            message: str) -> FineTuningJob:
    """Apply ``event`` to the caller's job if it is in one of ``allowed`` (Conflict otherwise), committed."""
    def change(job: FineTuningJob) -> bool:
        state = JobState(job.status)
        if state not in allowed:
            names = " or ".join(sorted(s.value for s in allowed))
            raise Conflict(f"job {job_id} is {state.value}: only a {names} job can {event.value}",
                           code="invalid_state")
        apply_event(session, job, event, message=message)
        return True

    return _retrying(session, principal, job_id, change)


def pause_job(*, session: Session, settings: Settings, principal: Principal, job_id: str,
              control: PauseControl | None) -> FineTuningJob:
    """Pause a queued or running job (idempotent): ``paused`` at once; Slurm holds it, the trainer
    checkpoints after its current step and leaves the GPU. Conflict (409) in any other state or
    without Slurm (local mode)."""
    get_job(session=session, principal=principal, job_id=job_id)     # a foreign id: 404 in any mode
    if control is None or settings.local:
        raise Conflict("pausing needs Slurm: this gateway runs jobs in local mode", code="not_supported")
    job = _change(session, principal, job_id, Event.PAUSE, {JobState.QUEUED, JobState.RUNNING, JobState.PAUSED},
                  "Pause requested: the job checkpoints and leaves its GPU; resume continues from there")
    control.start_pause(job.slurm_job_id, _tenant_name(session, job))
    return job


def resume_job(*, session: Session, settings: Settings, principal: Principal, job_id: str,
               control: PauseControl | None) -> FineTuningJob:
    """Resume a paused job: ``queued`` again, the hold released; it continues from its newest
    checkpoint when Slurm starts it. Conflict (409) unless it is paused."""
    job = get_job(session=session, principal=principal, job_id=job_id)     # a foreign id: 404 in any mode
    if control is None or settings.local:
        raise Conflict("pausing needs Slurm: this gateway runs jobs in local mode", code="not_supported")
    if job.status != JobState.PAUSED.value:
        raise Conflict(f"job {job_id} is {job.status}: only a paused job can resume", code="invalid_state")
    # Slurm first: if the release fails the job stays paused (and held); if the state change
    # then loses a race, the reconciler holds it again when it starts (a paused job never runs)
    try:
        control.release(job.slurm_job_id, _tenant_name(session, job))
    except SlurmError as e:
        raise Conflict(f"Slurm did not release job {job_id} ({e}); it stays paused: try again",
                       code="busy") from None
    return _change(session, principal, job_id, Event.RESUME, {JobState.PAUSED},
                   "Resumed: queued again; it continues from its last checkpoint")
