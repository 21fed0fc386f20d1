"""The reconciler: brings every active job in line with Slurm and the trainer's events.

Owns the loop: one cycle = ONE batched Slurm query for all active jobs
(``SlurmClient.states``: one squeue + at most one sacct) and ONE events read per
tenant, whatever their number; then per job the trainer's new events
(``services.progress``), the step ``jobs.state.decide`` picks from Slurm's state, and
publication (``services.publication``); then cleanup confirmation, recovery of
interrupted submissions and the temp sweep. A failed Slurm query changes nothing and
backs off. It may import the state machine, the services, storage and the Slurm
client; all state is in the database, so a restarted gateway picks up where it stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property, partial
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gateway.config import Settings
from gateway.errors import ServiceError, SlurmError
from gateway.jobs import detectors
from gateway.jobs.leader import Lease, LeaseLost
from gateway.jobs.tenantcalls import Round, TenantCalls
from gateway.models import FineTuningJob, Tenant, utcnow
from gateway.services import jobcreate, webhooks
from gateway.services.jobwrites import StaleJob, add_event, apply_event, update_fields
from gateway.services.progress import ingest_events, trainer_failure
from gateway.services.publication import fine_tuned_model_name as fine_tuned_model_name  # re-exported
from gateway.services.publication import publish_attempt
from gateway.services.recovery import resubmittable_spec
from gateway.slurm.client import JobStatus
from gateway.slurm.records import Owner, SlurmParseError, expand_nodelist
from gateway.slurm.scheduler import Scheduler
from gateway.slurm.scrubreports import ScrubReportError, read_report, report_path
from gateway.state import Action, Cleanup, Event, FailReason, JobState, SlurmState, decide, from_slurm
from gateway.storage import storage_for
from gateway.storage.layout import unix_user_for

log = logging.getLogger(__name__)
WATCHED = (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED, JobState.PUBLISHING, JobState.CANCELLING)
SWEEP_EVERY_S = 60.0       # look for leftovers of interrupted publications this often
SWEEP_MIN_AGE_S = 60.0     # older than any publication in flight (they take well under a second)


@dataclass
class CycleStats:
    jobs: int = 0
    slurm_calls: int = 0
    changed: int = 0
    published: int = 0
    errors: list[str] = field(default_factory=list)


START_REFRESH_S = 30.0     # how often queued jobs' expected starts are read again


@dataclass
class LoopStats:
    """What the loop did since start, for /metrics: cycles, their seconds, the failed ones by cause, and
    the tenants' storage calls that gave a cycle no answer, by (verb, outcome): ``error``, ``late`` (the
    cycle stopped waiting) or ``skipped`` (not made: the tenant's previous call still ran, or it pauses
    after a failure)."""

    cycles: int = 0
    seconds: float = 0.0
    last_seconds: float = 0.0
    failed: dict[str, int] = field(default_factory=dict)
    storage_missed: dict[tuple[str, str], int] = field(default_factory=dict)

    def observe(self, seconds: float, failed: str | None = None) -> None:
        """Count one cycle of ``seconds`` (``failed``: why it failed, "slurm", "lease" or "internal")."""
        self.cycles += 1
        self.seconds += seconds
        self.last_seconds = seconds
        if failed:
            self.failed[failed] = self.failed.get(failed, 0) + 1


class Reconciler:
    """Owns the Slurm client; ``cycle`` once, or ``run`` in a thread until stopped."""

    def __init__(self, engine: Engine, settings: Settings, client: Scheduler,
                 submitter: jobcreate.Submit | None = None):
        self.engine, self.settings, self.client, self.submitter = engine, settings, client, submitter
        self.storage = storage_for(settings)
        self.stop = threading.Event()
        self._cancelling: set[int] = set()
        self._pausing: set[int] = set()
        self._next_sweep = 0.0
        self._lock = threading.Lock()
        self.limits = detectors.Limits(stall_factor=settings.stall_factor, stall_min_s=settings.stall_min_s,
                                       stall_requeue_s=settings.stall_requeue_s)
        self.detector_counts: dict[str, int] = {}     # findings raised since start, by rule
        self.stats = LoopStats()
        self._delivering = False
        self._next_starts = 0.0
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
                    self.start_deliveries()
                self.stop.wait(delay)
        finally:
            try:
                self.lease.release()
            except Exception as e:
                log.warning("could not release the reconciler lease (%s): a peer takes over when it expires", e)

    def start_deliveries(self) -> None:
        """POST the due webhook deliveries (``services.webhooks.deliver_due``) in a thread, one at a time:
        a slow receiver never delays a cycle."""
        with self._lock:
            if self._delivering:
                return
            self._delivering = True

        def work() -> None:
            try:
                webhooks.deliver_due(self.engine, self.settings)
            except Exception:
                log.exception("webhook deliveries failed")
            finally:
                with self._lock:
                    self._delivering = False

        threading.Thread(target=work, name="webhooks", daemon=True).start()

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
                self._expected_starts(s, jobs, states)
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
                    except StaleJob:
                        s.rollback()       # someone else changed it: next cycle decides
                    except LeaseLost:
                        s.rollback()       # another gateway leads now: stop this cycle
                        raise
                    except Exception as e:
                        s.rollback()
                        log.exception("job %s: reconcile step failed", job.id)
                        stats.errors.append(f"{job.id}: {type(e).__name__}")
            self._confirm_cleanups(s)
            self._recover_submissions(s)
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

    @cached_property
    def _tenant_calls(self) -> TenantCalls:
        return TenantCalls()

    def _storage_round(self, verb: str, calls: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run one storage call per tenant (``TenantCalls``, bounded by ``broker_cycle_timeout_s``); log
        (once per run of failures: repeats while pausing at debug level) and count the tenants that
        failed, were late or were skipped; the answers by tenant."""
        rnd: Round[Any] = self._tenant_calls.run(calls, self.settings.broker_cycle_timeout_s)
        for name, e in rnd.failed.items():
            level = logging.DEBUG if name in rnd.repeated else logging.WARNING
            if isinstance(e, ServiceError):
                log.log(level, "tenant %s: %s failed: %s (it pauses; the others go on)", name, verb, e.message)
            else:      # a bug in one tenant's call must not fail every tenant's cycle
                log.error("tenant %s: %s failed", name, verb, exc_info=e)
        for name in rnd.late:
            log.log(logging.DEBUG if name in rnd.repeated else logging.WARNING, "tenant %s: storage %s did not "
                    "answer within %.1fs: left for a later cycle (the others go on)", name, verb,
                    self.settings.broker_cycle_timeout_s)
        for outcome, n in (("error", len(rnd.failed)), ("late", len(rnd.late)), ("skipped", len(rnd.skipped))):
            if n:
                self.stats.storage_missed[verb, outcome] = self.stats.storage_missed.get((verb, outcome), 0) + n
        return rnd.results

    def _recover_submissions(self, s: Session) -> None:
        """Jobs recorded but never handed to Slurm (the gateway died between its commit and
        sbatch): adopt the Slurm job if sbatch did run (found by name), else submit again."""
        # A request may still be inside Submitter (sacctmgr, then sbatch: each up to slurm_timeout_s):
        # recovering before those could end would submit the job a second time.
        in_flight = 2 * self.settings.slurm_timeout_s + 5
        cutoff = utcnow() - timedelta(seconds=max(self.settings.submission_grace_s, in_flight))
        # a sweep's submission makes 2 Slurm calls per run after sbatch (name, release), each up to the timeout
        sweep_cutoff = cutoff - timedelta(seconds=2 * self.settings.max_sweep_runs * self.settings.slurm_timeout_s)
        lost = [j for j in s.exec(select(FineTuningJob).where(
            FineTuningJob.status == JobState.VALIDATING_FILES.value,
            col(FineTuningJob.slurm_job_id).is_(None), col(FineTuningJob.created_at) < cutoff))
            if j.sweep_id is None or j.created_at < sweep_cutoff]
        if not lost:
            return
        if self.fence is not None:
            self.fence.check(s)    # sbatch follows: only the leader may submit again
        tenants = {t.id: t for t in s.exec(select(Tenant))}
        owners = {j.id: self.owner(tenants[j.tenant_id].name) for j in lost}
        # only the tenant's own jobs under the job's name, submitted since the job was recorded
        found = self.client.find_by_name(owners, since=min(j.created_at for j in lost))
        self._drop_unnamed_tasks({j.sweep_id: owners[j.id] for j in lost if j.sweep_id})
        for job in lost:
            tenant = tenants[job.tenant_id]
            try:
                if job.id in found:
                    apply_event(s, job, Event.SUBMITTED, message=f"Recovered: Slurm job {found[job.id]} "
                                "was submitted before the gateway restarted", slurm_job_id=found[job.id])
                    if job.sweep_id:
                        self._release_adopted(found[job.id], owners[job.id])
                elif self.submitter is not None and (spec := resubmittable_spec(
                        session=s, settings=self.settings, storage=self.storage, job=job, tenant=tenant)) is not None:
                    add_event(s, job.id, "Submitting again: the gateway stopped before Slurm had the job")
                    jobcreate.submit_job(session=s, job=job, spec=spec, tenant=tenant.name, submit=self.submitter)
                else:
                    apply_event(s, job, Event.ERROR, level="error", message="Job failed: submission was "
                                "interrupted; create the job again",
                                error={"code": "submission_lost", "message": "submission was interrupted",
                                       "param": None, "reason": FailReason.INTERNAL.value}, finished_at=utcnow())
                s.commit()
            except StaleJob:
                s.rollback()

    def _expected_starts(self, s: Session, jobs: list[FineTuningJob], states: dict[int, JobStatus]) -> None:
        """Keep each queued job's expected start as Slurm plans it (``squeue --start``: ONE call, only when
        some job is pending, at most every START_REFRESH_S); written only when it moved by a minute or more."""
        from gateway.slurm.client import SlurmClient

        pending = [j for j in jobs if j.status == JobState.QUEUED.value and j.slurm_job_id
                   and states.get(j.slurm_job_id) is not None and states[j.slurm_job_id].state == SlurmState.PENDING]
        if not pending or not isinstance(self.client, SlurmClient) or time.monotonic() < self._next_starts:
            return
        self._next_starts = time.monotonic() + START_REFRESH_S
        try:
            starts = self.client.pending_starts([j.slurm_job_id for j in pending if j.slurm_job_id])
        except SlurmError as e:
            log.info("squeue --start failed: %s", e)
            return
        for job in pending:
            new = starts.get(job.slurm_job_id) if job.slurm_job_id else None
            old = job.expected_start
            if new is not None and (old is None or abs((new - old).total_seconds()) >= 60):
                try:
                    update_fields(s, job, expected_start=new)
                    s.commit()
                except StaleJob:
                    s.rollback()

    def _drop_unnamed_tasks(self, sweeps: dict[str, Owner]) -> None:
        """Cancel the tasks of interrupted sweeps' arrays that were never named after their job (the
        gateway died between sbatch and naming them): held, they never ran, and their jobs are
        submitted again one by one. Tasks already named are adopted like any job."""
        from gateway.slurm.client import SlurmClient

        client = self.client
        if not sweeps or not isinstance(client, SlurmClient):
            return
        for sweep_id, array_id in client.find_by_name(sweeps).items():
            for task, q in client.array_tasks(array_id, owner=sweeps[sweep_id], name=sweep_id).items():
                log.warning("sweep %s: cancelling task %d of array %d (never named: its job is "
                            "submitted again)", sweep_id, task, array_id)
                client.cancel_task(q, owner=sweeps[sweep_id])

    def _release_adopted(self, slurm_id: int, owner: Owner) -> None:
        """Release an adopted sweep task: the gateway may have died before it released the hold."""
        from gateway.slurm.client import SlurmClient

        if isinstance(self.client, SlurmClient):
            try:
                self.client.release(slurm_id, owner=owner)
            except SlurmError as e:       # not held (already released, or running)
                log.info("Slurm job %d: nothing to release (%s)", slurm_id, e)

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
                        stop_confirmed_at=utcnow(), finished_at=utcnow(), cleanup=Cleanup.PENDING)
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
                        finished_at=utcnow(), stop_confirmed_at=utcnow(), cleanup=Cleanup.PENDING)
        elif d.action is Action.NOTHING and state is JobState.RUNNING and st.state == SlurmState.RUNNING:
            self._detect(s, job, tenant, st)
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

    def _detect(self, s: Session, job: FineTuningJob, tenant: Tenant, st: JobStatus) -> None:
        """Run the detectors on a running job: each new finding once per attempt as a warning event
        (and a count for /metrics); a stall past its grace requeues the job in Slurm."""
        progress = dict(job.progress or {})
        start = st.queue.start if st.queue is not None else None
        time_left = ((start.timestamp() + (job.time_limit_min or 60) * 60) - time.time()) if start else None
        every = int((job.hyperparameters or {}).get("checkpoint_every_steps") or self.settings.checkpoint_every_steps)
        findings = detectors.check(progress, attempt=job.attempt, now=time.time(), checkpoint_every=every,
                                   time_left_s=time_left, grace_s=self.settings.signal_grace_s,
                                   limits=self.limits, running_since=start.timestamp() if start else None)
        fired = dict(progress.get("fired") or {})
        new = [f for f in findings if fired.get(f.rule) != job.attempt]
        if not new:
            return
        for f in new:
            fired[f.rule] = job.attempt
            self.detector_counts[f.rule] = self.detector_counts.get(f.rule, 0) + 1
            add_event(s, job.id, f"Detector {f.rule}: {f.message}", level="warn",
                      data={"detector": f.rule, "attempt": job.attempt})
            log.warning("job %s: detector %s fired (attempt %d)", job.id, f.rule, job.attempt)
        update_fields(s, job, progress={**progress, "fired": fired})
        if any(f.requeue for f in new) and job.slurm_job_id is not None:
            try:
                self.client.requeue(job.slurm_job_id, owner=self.owner(tenant.name))
            except SlurmError as e:
                log.warning("job %s: requeue after a stall failed: %s", job.id, e)

    def _publish(self, s: Session, job: FineTuningJob, tenant: Tenant) -> None:
        # one name for the race test (tests/service/test_publication_race.py) to drive publication by
        if self.fence is not None:
            self.fence.check(s)    # the broker publishes next: only the leader may
        publish_attempt(session=s, settings=self.settings, storage=self.storage, job=job, tenant_name=tenant.name)

    def owner(self, tenant: str) -> Owner:
        """Whose Slurm jobs ``tenant``'s are: its unix user and account (local mode: every job is this
        user's, so only the account is known)."""
        return Owner(None if self.settings.local else unix_user_for(tenant), tenant)

    def start_cancel(self, slurm_id: int | None, tenant: str) -> None:
        """Run ``SlurmClient.cancel`` in a thread, once per Slurm job at a time, for ``tenant``'s job only."""
        if slurm_id is None:
            return
        with self._lock:
            if slurm_id in self._cancelling:
                return
            self._cancelling.add(slurm_id)

        def work() -> None:
            try:
                res = self.client.cancel(slurm_id, owner=self.owner(tenant), deadline_s=self.settings.cancel_deadline_s)
                log.info("Slurm job %s stopped %.2fs after cancel (escalated=%s)", slurm_id, res.seconds,
                         res.escalated)
            except SlurmError as e:
                log.warning("cancel of Slurm job %s: %s", slurm_id, e)
            finally:
                with self._lock:
                    self._cancelling.discard(slurm_id)

        threading.Thread(target=work, name=f"cancel-{slurm_id}", daemon=True).start()

    def start_pause(self, slurm_id: int | None, tenant: str) -> None:
        """Hold the Slurm job and send it the checkpoint signal (``SlurmClient.pause``), once per
        job at a time, in a thread; the reconciler repeats it while Slurm still runs the job."""
        if slurm_id is None:
            return
        with self._lock:
            if slurm_id in self._pausing:
                return
            self._pausing.add(slurm_id)

        def work() -> None:
            try:
                was = self.client.pause(slurm_id, owner=self.owner(tenant))
                log.info("Slurm job %s: pause (was %s)", slurm_id, was)
            except SlurmError as e:
                log.warning("pause of Slurm job %s: %s", slurm_id, e)
            finally:
                with self._lock:
                    self._pausing.discard(slurm_id)

        threading.Thread(target=work, name=f"pause-{slurm_id}", daemon=True).start()

    def release(self, slurm_id: int | None, tenant: str) -> None:
        """Release ``tenant``'s Slurm job's hold now (the resume); SlurmError when Slurm refuses or the
        job is not the tenant's."""
        if slurm_id is not None:
            self.client.release(slurm_id, owner=self.owner(tenant))

    # -------------------------------------------------------------- cleanup
    def _confirm_cleanups(self, s: Session) -> None:
        for job in list(s.exec(select(FineTuningJob).where(FineTuningJob.cleanup == Cleanup.PENDING))):
            if self.settings.local:       # no nodes, no scrubber: nothing will ever confirm a cleanup
                self._set_cleanup(s, job, Cleanup.OFF, "No node cleanup in local mode (no scrubber runs)", "warn")
            elif (ok := self._epilog_ok(job)) is not None:
                if ok:
                    self._set_cleanup(s, job, Cleanup.CONFIRMED, "Node cleanup confirmed by the epilog", "info")
                else:
                    self._set_cleanup(s, job, Cleanup.FAILED,
                                      "Node cleanup FAILED: the node was drained for an administrator", "warn")

    def _epilog_ok(self, job: FineTuningJob) -> bool | None:
        """Whether the epilog's scrub reports for ``job`` say every node of it is clean: False when
        one is not (or its list cannot be read), None while a node's report is missing."""
        nodelist = (job.progress or {}).get("node")
        if not nodelist or job.slurm_job_id is None:
            return None
        try:
            nodes = expand_nodelist(str(nodelist))
        except SlurmParseError:
            return False
        verdicts: list[bool | None] = []
        for node in nodes:
            path = report_path(self.settings.scrub_report_dir, node, job.slurm_job_id, "epilog")
            if not path.exists():
                verdicts.append(None)
                continue
            try:
                verdicts.append(read_report(path).ok)
            except ScrubReportError:
                verdicts.append(False)
        if False in verdicts or not verdicts:
            return False
        return None if None in verdicts else True

    def _set_cleanup(self, s: Session, job: FineTuningJob, cleanup: str, message: str, level: str) -> None:
        try:
            update_fields(s, job, cleanup=cleanup)
            add_event(s, job.id, message, level=level)
            s.commit()
        except StaleJob:
            s.rollback()
