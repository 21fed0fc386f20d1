"""The reconciler: brings every active job in line with Slurm and the trainer's events.

Owns the loop: one cycle = ONE batched Slurm query for all active jobs
(``Scheduler.states``: one squeue + at most one sacct) and ONE events read per
tenant, whatever their number; then per job the trainer's new events
(``services.progress``), the step ``state.decide`` picks from Slurm's state, and
publication (``services.publication``). A failed Slurm query changes nothing and backs off.
All state is in the database, so a restarted gateway picks up where it stopped.

What the loop calls lives in rooms of its own: ``expected`` (queued jobs' expected starts),
``watch`` (the detectors on a running job), ``workers`` (cancel, pause and webhook threads),
``cleanup`` (the epilog's confirmation), ``recovery`` (interrupted submissions and sweeps),
``tenantcalls`` (the per-tenant storage rounds), ``loopstats`` (what /metrics reports) and ``sweeper``
(the retention pass, started after a cycle in a thread of its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gateway.config import Settings
from gateway.errors import SlurmError
from gateway.jobs import detectors
from gateway.jobs.cleanup import confirm_cleanups
from gateway.jobs.expected import ExpectedStarts
from gateway.jobs.leader import Lease, LeaseLost
from gateway.jobs.loopstats import CycleStats, LoopStats
from gateway.jobs.recovery import recover_submissions
from gateway.jobs.sweeper import RetentionSweeper
from gateway.jobs.tenantcalls import TenantCalls, report
from gateway.jobs.watch import watch_running
from gateway.jobs.workers import Workers
from gateway.models import FineTuningJob, Tenant, utcnow
from gateway.services import jobcreate
from gateway.services.checkpointpub import UNPUBLISHED_ENDS
from gateway.services.jobwrites import StaleJob, add_event, apply_event, update_fields
from gateway.services.progress import ingest_events, trainer_failure
from gateway.services.publication import publish_attempt
from gateway.slurm.client import JobStatus
from gateway.slurm.records import Owner
from gateway.slurm.scheduler import Scheduler
from gateway.state import Action, Cleanup, Event, JobState, SlurmState, decide, from_slurm
from gateway.storage import storage_for
from gateway.storage.layout import unix_user_for

log = logging.getLogger(__name__)
WATCHED = (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED, JobState.PUBLISHING, JobState.CANCELLING)
SWEEP_EVERY_S = 60.0       # look for leftovers of interrupted publications this often
SWEEP_MIN_AGE_S = 60.0     # older than any publication in flight (they take well under a second)


class Reconciler:
    """Owns the Slurm client; ``cycle`` once, or ``run`` in a thread until stopped."""

    def __init__(self, engine: Engine, settings: Settings, client: Scheduler,
                 submitter: jobcreate.Submit | None = None):
        self.engine, self.settings, self.client, self.submitter = engine, settings, client, submitter
        self.storage = storage_for(settings)
        self.stop = threading.Event()
        self.workers = Workers(engine, settings, client, self.owner)
        self.sweeper = RetentionSweeper(engine, settings, self.storage)     # its own thread, never in a cycle
        self.starts = ExpectedStarts(client)
        self._next_sweep = 0.0
        self._tenant_calls = TenantCalls()
        self.limits = detectors.Limits(stall_factor=settings.stall_factor, stall_min_s=settings.stall_min_s,
                                       stall_requeue_s=settings.stall_requeue_s)
        self.detector_counts: dict[str, int] = {}     # findings raised since start, by rule
        self.stats = LoopStats()
        self.alerts = 0           # records not acted on (another owner's, or untrustworthy), for /metrics
        self._alerted: set[tuple[str, int | None, str]] = set()
        self.lease = Lease(engine, "reconciler", ttl_s=settings.reconciler_lease_s)
        self.fence: Lease | None = None       # set by ``run``: every cycle's writes are fenced by the lease

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """While ``stop`` is not set: hold the reconciler lease (gateway.jobs.leader) and run ``cycle`` every
        ``reconcile_interval_s``, or stand by while another gateway holds it. A failing cycle is logged and
        retried with a doubling delay (at most ``reconcile_max_backoff_s``). The lease is released on stop."""
        delay = self.settings.reconcile_interval_s
        self.fence = self.lease
        try:
            while not self.stop.is_set():
                try:
                    leader = self.lease.hold()
                except Exception as e:         # the database is unreachable: no leader can write either
                    log.warning("reconciler lease unreadable (%s); retrying", e)
                    leader = False
                if not leader:
                    self.stop.wait(min(self.settings.reconcile_interval_s, self.lease.ttl_s / 3))
                    continue
                t0 = time.perf_counter()
                try:
                    self.cycle()
                    delay = self.settings.reconcile_interval_s
                    self.stats.observe(time.perf_counter() - t0)
                except LeaseLost as e:
                    log.warning("%s: this gateway stands by", e)
                    self.stats.observe(time.perf_counter() - t0, failed="lease")
                    delay = self.settings.reconcile_interval_s
                except SlurmError as e:
                    delay = min(self.settings.reconcile_max_backoff_s, max(delay * 2, 1.0))
                    self.stats.observe(time.perf_counter() - t0, failed="slurm")
                    log.warning("Slurm query failed (%s); no job changed; retrying in %.0fs", e, delay)
                except Exception:
                    delay = min(self.settings.reconcile_max_backoff_s, max(delay * 2, 1.0))
                    self.stats.observe(time.perf_counter() - t0, failed="internal")
                    log.exception("reconcile cycle failed; retrying in %.0fs", delay)
                if self.lease.held:
                    self.workers.start_deliveries()
                    self.workers.start_tracking()
                    self.sweeper.start(self.fence)
                self.stop.wait(delay)
        finally:
            try:
                self.lease.release()
            except Exception as e:
                log.warning("could not release the reconciler lease (%s): a peer takes over when it expires", e)

    def cycle(self) -> CycleStats:
        """One pass over every active job. Raises SlurmError (nothing changed) if Slurm fails."""
        stats = CycleStats()
        with Session(self.engine, expire_on_commit=False) as s:
            if self.fence is not None:
                self.fence.guard(s)
            jobs = list(s.exec(select(FineTuningJob).where(
                col(FineTuningJob.status).in_([w.value for w in WATCHED]),
                col(FineTuningJob.slurm_job_id).is_not(None))))
            stats.jobs = len(jobs)
            if jobs:
                states = self.client.states([j.slurm_job_id for j in jobs if j.slurm_job_id])
                stats.slurm_calls = 1
                self.starts.refresh(s, jobs, states)
                tenants = {t.id: t for t in s.exec(select(Tenant))}
                events = self._read_events(jobs, tenants)
                for job in jobs:
                    assert job.slurm_job_id is not None
                    try:
                        if self._one(s, job, tenants[job.tenant_id], states[job.slurm_job_id],
                                     events.get(job.id, b"")):
                            stats.changed += 1
                        if job.status == JobState.SUCCEEDED:
                            stats.published += 1
                        s.commit()
                        if job.status in UNPUBLISHED_ENDS:
                            # it ended now (WATCHED holds no ended job): its checkpoints become adapters
                            self.workers.start_checkpoints(job.id, tenants[job.tenant_id].name, self.storage,
                                                           self.fence)
                    except StaleJob:
                        s.rollback()       # someone else changed it: next cycle decides
                    except LeaseLost:
                        s.rollback()       # another gateway leads now: stop this cycle
                        raise
                    except Exception as e:
                        s.rollback()
                        log.exception("job %s: reconcile step failed", job.id)
                        stats.errors.append(f"{job.id}: {type(e).__name__}")
            confirm_cleanups(s, self.settings)
            recover_submissions(s, settings=self.settings, client=self.client, storage=self.storage,
                                submitter=self.submitter, owner=self.owner, fence=self.fence)
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + SWEEP_EVERY_S
                self._sweep_artifacts(s)
        return stats

    def _read_events(self, jobs: list[FineTuningJob], tenants: dict[int | None, Tenant]) -> dict[str, bytes]:
        """New trainer events of every active job: ONE broker request per tenant per cycle, the tenants'
        side by side, waited for at most ``broker_cycle_timeout_s`` together. A tenant that did not answer
        in time (or is still busy or pausing: ``TenantCalls``) is read in a later cycle: ingestion starts
        at each job's recorded offset, so its jobs lose nothing, and it never stalls another tenant's."""
        by_tenant: dict[str, dict[str, int]] = {}
        for job in jobs:
            by_tenant.setdefault(tenants[job.tenant_id].name, {})[job.id] = job.events_offset
        calls = {name: partial(self.storage.tenant(name).read_events, offsets) for name, offsets in by_tenant.items()}
        got = self._storage_round("read_events", calls)
        out: dict[str, bytes] = {}
        for events in got.values():
            out.update(events)
        return out

    def _sweep_artifacts(self, s: Session) -> None:
        """Remove temp names of publications and uploads cut short by a crash (hidden ``.pub-*``
        dirs and ``.upload-*.tmp`` files older than any in flight; published dirs are never touched:
        a DB restored from an older backup must not turn newer results into garbage). Per tenant side
        by side, bounded like ``_read_events``; a tenant left out is swept next time."""
        names = [t.name for t in s.exec(select(Tenant))]
        swept = self._storage_round("sweep", {n: partial(self.storage.tenant(n).sweep, SWEEP_MIN_AGE_S) for n in names})
        for name, n in swept.items():
            if n:
                log.warning("tenant %s: removed %d leftovers of interrupted publications/uploads", name, n)

    def _storage_round(self, verb: str, calls: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run one storage call per tenant (``TenantCalls``, bounded by ``broker_cycle_timeout_s``), logged
        and counted (``tenantcalls.report``); the answers by tenant."""
        wait_s = self.settings.broker_cycle_timeout_s
        return report(self._tenant_calls.run(calls, wait_s), verb, wait_s, self.stats.storage_missed)

    # ------------------------------------------------------------- per job
    def _one(self, s: Session, job: FineTuningJob, tenant: Tenant, st: JobStatus, events: bytes) -> bool:
        before = job.status
        ingest_events(session=s, job=job, data=events)
        if (problem := st.owner_problem(self.owner(tenant.name))) is not None:
            self._alert(s, job, problem)     # nothing Slurm says of this id is acted on
            return job.status != before
        node = (st.queue.nodes if st.queue else None) or (st.acct.nodes if st.acct else None)
        if node and (job.progress or {}).get("node") != node:
            update_fields(s, job, progress={**(job.progress or {}), "node": node}, slurm_state=st.state)
        elif st.state and st.state != job.slurm_state:
            update_fields(s, job, slurm_state=st.state)
        state = JobState(job.status)
        exit_code = st.acct.exit[0] if st.acct and st.acct.exit else None
        view = from_slurm(st.state, exit_code, was_running=state is JobState.RUNNING)
        d = decide(state, view, gone=not st.active, trainer_failure=trainer_failure(job))
        if d.action is Action.CANCEL:
            self.start_cancel(job.slurm_job_id, tenant.name)
        elif d.action is Action.PAUSE:
            self.start_pause(job.slurm_job_id, tenant.name)
        elif d.action is Action.CANCELLED:
            apply_event(s, job, Event.STOPPED, message="Job cancelled: Slurm confirms no process is left",
                        stop_confirmed_at=utcnow(), finished_at=utcnow(), cleanup=_cleanup_after(job))
        elif d.action is Action.PUBLISH:
            self._publish(s, job, tenant)
        elif d.action is Action.START:
            apply_event(s, job, Event.STARTED, message=f"Job started on {node or 'a node'}",
                        started_at=job.started_at or utcnow())
        elif d.action is Action.REQUEUE:
            apply_event(s, job, Event.REQUEUED, message="Job requeued by Slurm; it will resume from "
                        "its last checkpoint")
        elif d.action is Action.COMPLETE:
            apply_event(s, job, Event.COMPLETED, message="Training finished; publishing the results")
            self._publish(s, job, tenant)
        elif d.action is Action.FAIL:
            assert d.reason is not None
            apply_event(s, job, Event.ERROR, level="error", message=f"Job failed: {d.message}",
                        error={"code": d.reason.value, "message": d.message, "param": None,
                               "reason": d.reason.value},
                        finished_at=utcnow(), stop_confirmed_at=utcnow(), cleanup=_cleanup_after(job))
        elif d.action is Action.NOTHING and state is JobState.RUNNING and st.state == SlurmState.RUNNING:
            watch_running(s, job, st, settings=self.settings, limits=self.limits, counts=self.detector_counts,
                          client=self.client, owner=self.owner(tenant.name))
        return job.status != before

    def _alert(self, s: Session, job: FineTuningJob, problem: str) -> None:
        """A job whose Slurm id has a record that is not its tenant's (another user's or account's) or
        that cannot be trusted: an alert for the administrators (log, /metrics) and once a warning
        event for the tenant, never an action. A record that reads right again ends it."""
        self.alerts += 1
        key = (job.id, job.slurm_job_id, problem)
        if key in self._alerted:
            return
        self._alerted.add(key)
        log.error("ALERT job %s: Slurm job %s is not acted on: %s", job.id, job.slurm_job_id, problem)
        add_event(s, job.id, f"Slurm job {job.slurm_job_id}: the gateway does not act on its records ({problem}); "
                  "the administrators are alerted", level="warn", data={"alert": "slurm_record"})

    def _publish(self, s: Session, job: FineTuningJob, tenant: Tenant) -> None:
        # one name for the race test (tests/service/test_publication_race.py) to drive publication by
        if self.fence is not None:
            self.fence.check(s)    # the broker publishes next: only the leader may
        publish_attempt(session=s, settings=self.settings, storage=self.storage, job=job, tenant_name=tenant.name)

    def owner(self, tenant: str) -> Owner:
        """Whose Slurm jobs ``tenant``'s are: its unix user and account (local mode: every job is this
        user's, so only the account is known)."""
        return Owner(None if self.settings.local else unix_user_for(tenant), tenant)

    # the API's cancel, pause and resume (``services.jobcontrol``) tell Slurm through these
    def start_cancel(self, slurm_id: int | None, tenant: str) -> None:
        """Stop ``tenant``'s Slurm job in a thread (``Workers.start_cancel``)."""
        self.workers.start_cancel(slurm_id, tenant)

    def start_pause(self, slurm_id: int | None, tenant: str) -> None:
        """Hold ``tenant``'s Slurm job and make it checkpoint, in a thread (``Workers.start_pause``)."""
        self.workers.start_pause(slurm_id, tenant)

    def release(self, slurm_id: int | None, tenant: str) -> None:
        """Release ``tenant``'s Slurm job's hold now; SlurmError when Slurm refuses (``Workers.release``)."""
        self.workers.release(slurm_id, tenant)


def _cleanup_after(job: FineTuningJob) -> Cleanup | None:
    """The cleanup a job that ended unpublished waits for: its nodes' epilog reports when it ran on
    nodes (Slurm's queue or accounting named them), none when it never did (cancelled or failed
    while pending: no epilog will ever report, so ``pending`` would never settle)."""
    return Cleanup.PENDING if (job.progress or {}).get("node") else None
