"""Recovery of interrupted submissions: jobs recorded but never handed to Slurm, because the
gateway died between its commit and sbatch (or, for a sweep, between sbatch and naming the
array's tasks).

Each such job is adopted when sbatch did run (its Slurm job found by name among its tenant's
jobs submitted since it was recorded; an adopted sweep task is released, as the dead gateway may
not have), else submitted again from the spec the database row gives
(``services.recovery.resubmittable_spec``), else failed as ``submission_lost``. A sweep array's
tasks never named after their job are cancelled first: held, they never ran, and their jobs are
submitted again one by one. The reconciler calls ``recover_submissions`` once per cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sqlmodel import Session, col, select

from gateway.config import Settings
from gateway.errors import SlurmError
from gateway.jobs.leader import Lease
from gateway.models import FineTuningJob, Tenant, utcnow
from gateway.services import jobcreate
from gateway.services.jobwrites import StaleJob, add_event, apply_event
from gateway.services.recovery import resubmittable_spec
from gateway.slurm.records import Owner
from gateway.slurm.scheduler import Scheduler
from gateway.state import Event, FailReason, JobState
from gateway.storage import Storage

log = logging.getLogger(__name__)


def lost_submissions(s: Session, settings: Settings) -> list[FineTuningJob]:
    """Jobs recorded but not in Slurm, older than any submission still in flight."""
    # A request may still be inside Submitter (sacctmgr, then sbatch: each up to slurm_timeout_s):
    # recovering before those could end would submit the job a second time.
    in_flight = 2 * settings.slurm_timeout_s + 5
    cutoff = utcnow() - timedelta(seconds=max(settings.submission_grace_s, in_flight))
    # a sweep's submission makes 2 Slurm calls per run after sbatch (name, release), each up to the timeout
    sweep_cutoff = cutoff - timedelta(seconds=2 * settings.max_sweep_runs * settings.slurm_timeout_s)
    return [j for j in s.exec(select(FineTuningJob).where(
        FineTuningJob.status == JobState.VALIDATING_FILES.value,
        col(FineTuningJob.slurm_job_id).is_(None), col(FineTuningJob.created_at) < cutoff))
        if j.sweep_id is None or j.created_at < sweep_cutoff]


def recover_submissions(s: Session, *, settings: Settings, client: Scheduler, storage: Storage,
                        submitter: jobcreate.Submit | None, owner: Callable[[str], Owner],
                        fence: Lease | None) -> None:
    """Jobs recorded but never handed to Slurm (the gateway died between its commit and
    sbatch): adopt the Slurm job if sbatch did run (found by name), else submit again."""
    lost = lost_submissions(s, settings)
    if not lost:
        return
    if fence is not None:
        fence.check(s)    # sbatch follows: only the leader may submit again
    tenants = {t.id: t for t in s.exec(select(Tenant))}
    owners = {j.id: owner(tenants[j.tenant_id].name) for j in lost}
    # only the tenant's own jobs under the job's name, submitted since the job was recorded
    found = client.find_by_name(owners, since=min(j.created_at for j in lost))
    # a sweep's array tasks never named after their job: held, they never ran; their jobs are submitted again
    client.cancel_unnamed_tasks({j.sweep_id: owners[j.id] for j in lost if j.sweep_id})
    for job in lost:
        tenant = tenants[job.tenant_id]
        try:
            if job.id in found:
                apply_event(s, job, Event.SUBMITTED, message=f"Recovered: Slurm job {found[job.id]} "
                            "was submitted before the gateway restarted", slurm_job_id=found[job.id])
                if job.sweep_id and not settings.local:     # local mode runs a sweep job by job: no hold
                    _release_adopted(client, found[job.id], owners[job.id])
            elif submitter is not None and (spec := resubmittable_spec(
                    session=s, settings=settings, storage=storage, job=job, tenant=tenant)) is not None:
                add_event(s, job.id, "Submitting again: the gateway stopped before Slurm had the job")
                jobcreate.submit_job(session=s, job=job, spec=spec, tenant=tenant.name, submit=submitter)
            else:
                apply_event(s, job, Event.ERROR, level="error", message="Job failed: submission was "
                            "interrupted; create the job again",
                            error={"code": "submission_lost", "message": "submission was interrupted",
                                   "param": None, "reason": FailReason.INTERNAL.value}, finished_at=utcnow())
            s.commit()
        except StaleJob:
            s.rollback()


def _release_adopted(client: Scheduler, slurm_id: int, owner: Owner) -> None:
    """Release an adopted sweep task: the gateway may have died before it released the hold."""
    try:
        client.release(slurm_id, owner=owner)
    except SlurmError as e:       # not held (already released, or running)
        log.info("Slurm job %d: nothing to release (%s)", slurm_id, e)
