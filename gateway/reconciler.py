"""The reconciler: brings every active job in line with Slurm and the trainer's events.

One cycle = ONE batched Slurm query for all active jobs (``SlurmClient.states``:
one squeue + at most one sacct), whatever their number; then per job: new trainer
events (phase, metrics, checkpoints, attempt), the state change Slurm implies,
publication of a completed attempt, cleanup confirmation from the scrub report.
A failed Slurm query changes nothing and backs off. All state is in the database,
so a restarted gateway picks up where it stopped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gateway import publish
from gateway.config import Settings
from gateway.jobstate import Event, FailReason, JobState, from_slurm
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, Tenant, new_id, utcnow
from gateway.services import Conflict, ServiceError
from gateway.services.jobs import StaleJob, add_event, apply_event, update_fields
from gateway.slurm.client import JobStatus, SlurmClient
from gateway.slurm.runner import SlurmError
from gateway.storage import layout, storage_for

log = logging.getLogger(__name__)
WATCHED = (JobState.QUEUED, JobState.RUNNING, JobState.PUBLISHING, JobState.CANCELLING)
SWEEP_EVERY_S = 60.0       # look for leftovers of interrupted publications this often
SWEEP_MIN_AGE_S = 60.0     # older than any publication in flight (they take well under a second)
PHASES = {"tokenizing": "tokenizing", "training": "training", "evaluating": "evaluating",
          "saving": "evaluating"}


@dataclass
class CycleStats:
    jobs: int = 0
    slurm_calls: int = 0
    changed: int = 0
    published: int = 0
    errors: list[str] = field(default_factory=list)


def fine_tuned_model_name(job: FineTuningJob, tenant: str) -> str:
    return f"ft:{job.model}:{tenant}:{job.suffix or ''}:{job.id}"


class Reconciler:
    """Owns the Slurm client; ``cycle`` once, or ``run`` in a thread until stopped."""

    def __init__(self, engine: Engine, settings: Settings, client: SlurmClient, submitter: Any = None):
        self.engine, self.settings, self.client, self.submitter = engine, settings, client, submitter
        self.storage = storage_for(settings)
        self.stop = threading.Event()
        self._cancelling: set[int] = set()
        self._next_sweep = 0.0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        delay = self.settings.reconcile_interval_s
        while not self.stop.is_set():
            try:
                self.cycle()
                delay = self.settings.reconcile_interval_s
            except SlurmError as e:
                delay = min(self.settings.reconcile_max_backoff_s, max(delay * 2, 1.0))
                log.warning("Slurm query failed (%s); no job changed; retrying in %.0fs", e, delay)
            except Exception:
                delay = min(self.settings.reconcile_max_backoff_s, max(delay * 2, 1.0))
                log.exception("reconcile cycle failed; retrying in %.0fs", delay)
            self.stop.wait(delay)

    def cycle(self) -> CycleStats:
        """One pass over every active job. Raises SlurmError (nothing changed) if Slurm fails."""
        stats = CycleStats()
        with Session(self.engine, expire_on_commit=False) as s:
            jobs = list(s.exec(select(FineTuningJob).where(
                col(FineTuningJob.status).in_([w.value for w in WATCHED]),
                col(FineTuningJob.slurm_job_id).is_not(None))))
            stats.jobs = len(jobs)
            if jobs:
                states = self.client.states([j.slurm_job_id for j in jobs if j.slurm_job_id])
                stats.slurm_calls = 1
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
        """New trainer events of every active job: ONE broker request per tenant per cycle."""
        by_tenant: dict[int, dict[str, int]] = {}
        for job in jobs:
            by_tenant.setdefault(job.tenant_id, {})[job.id] = job.events_offset
        out: dict[str, bytes] = {}
        for tid, offsets in by_tenant.items():
            try:
                out.update(self.storage.tenant(tenants[tid].name).read_events(offsets))
            except ServiceError as e:
                log.warning("tenant %s: trainer events unreadable this cycle: %s", tenants[tid].name, e.message)
        return out

    def _sweep_artifacts(self, s: Session) -> None:
        """Remove temp names of publications and uploads cut short by a crash (hidden ``.pub-*``
        dirs and ``.upload-*.tmp`` files older than any in flight; published dirs are never touched:
        a DB restored from an older backup must not turn newer results into garbage)."""
        for tenant in s.exec(select(Tenant)):
            try:
                if n := self.storage.tenant(tenant.name).sweep(SWEEP_MIN_AGE_S):
                    log.warning("tenant %s: removed %d leftovers of interrupted publications/uploads",
                                tenant.name, n)
            except ServiceError as e:
                log.warning("tenant %s: sweep failed: %s", tenant.name, e.message)

    def _recover_submissions(self, s: Session) -> None:
        """Jobs recorded but never handed to Slurm (the gateway died between its commit and
        sbatch): adopt the Slurm job if sbatch did run (found by name), else submit again."""
        # A request may still be inside Submitter (sacctmgr, then sbatch: each up to slurm_timeout_s):
        # recovering before those could end would submit the job a second time.
        in_flight = 2 * self.settings.slurm_timeout_s + 5
        cutoff = utcnow() - timedelta(seconds=max(self.settings.submission_grace_s, in_flight))
        lost = list(s.exec(select(FineTuningJob).where(
            FineTuningJob.status == JobState.VALIDATING_FILES.value,
            col(FineTuningJob.slurm_job_id).is_(None), col(FineTuningJob.created_at) < cutoff)))
        if not lost:
            return
        found = self.client.find_by_name([j.id for j in lost])
        tenants = {t.id: t for t in s.exec(select(Tenant))}
        for job in lost:
            tenant = tenants[job.tenant_id]
            try:
                if job.id in found:
                    apply_event(s, job, Event.SUBMITTED, message=f"Recovered: Slurm job {found[job.id]} "
                                "was submitted before the gateway restarted", slurm_job_id=found[job.id])
                elif self.submitter is not None and (spec := self._saved_spec(s, job, tenant)) is not None:
                    from gateway.services.jobs import submit_job

                    add_event(s, job.id, "Submitting again: the gateway stopped before Slurm had the job")
                    submit_job(session=s, job=job, spec=spec, tenant=tenant.name, submit=self.submitter)
                else:
                    apply_event(s, job, Event.ERROR, level="error", message="Job failed: submission was "
                                "interrupted; create the job again",
                                error={"code": "submission_lost", "message": "submission was interrupted",
                                       "param": None, "reason": FailReason.INTERNAL.value}, finished_at=utcnow())
                s.commit()
            except StaleJob:
                s.rollback()

    def _saved_spec(self, s: Session, job: FineTuningJob, tenant: Tenant) -> dict[str, Any] | None:
        """The spec to submit again, rebuilt from the job's row (the gateway's record); None if the
        job can no longer run. A spec.json left in tenant storage is untrusted (the tenant can
        rewrite it): it is parsed, validated and compared, and a mismatch is logged, never used."""
        spec = self._rebuilt_spec(s, job, tenant)
        if spec is not None:
            from gateway.services.jobs import saved_spec_matches

            try:
                saved = self.storage.tenant(tenant.name).read_spec(job.id)
            except ServiceError:
                saved = None
            if saved is not None and not saved_spec_matches(saved, spec):
                log.warning("job %s: the spec.json in tenant storage differs from the gateway's "
                            "record; submitting the recorded spec", job.id)
        return spec

    def _rebuilt_spec(self, s: Session, job: FineTuningJob, tenant: Tenant) -> dict[str, Any] | None:
        from gateway.models import Role
        from gateway.services import ServiceError
        from gateway.services.jobs import _catalog_entry, job_spec
        from gateway.services.tokens import Principal

        train = s.get(DataFile, job.training_file)
        val = s.get(DataFile, job.validation_file) if job.validation_file else None
        if train is None or train.deleted_at is not None or (val is not None and val.deleted_at is not None):
            return None
        owner = Principal(0, Role.MEMBER, tenant.id, tenant.name, tenant.unix_user)
        try:
            entry = _catalog_entry(self.settings, job.model)
            if job.model_digest and entry.digest != job.model_digest:
                return None
            return job_spec(self.settings, owner, job, train, val, entry)
        except ServiceError:
            return None

    # ------------------------------------------------------------- per job
    def _one(self, s: Session, job: FineTuningJob, tenant: Tenant, st: JobStatus, events: bytes) -> bool:
        before = job.status
        self._ingest_events(s, job, events)
        node = (st.queue.nodes if st.queue else None) or (st.acct.nodes if st.acct else None)
        if node and (job.progress or {}).get("node") != node:
            update_fields(s, job, progress={**(job.progress or {}), "node": node}, slurm_state=st.state)
        elif st.state and st.state != job.slurm_state:
            update_fields(s, job, slurm_state=st.state)
        state = JobState(job.status)
        exit_code = st.acct.exit[0] if st.acct and st.acct.exit else None
        view = from_slurm(st.state, exit_code, was_running=state is JobState.RUNNING)
        if state is JobState.CANCELLING:
            self._cancelling_step(s, job, st)
        elif state is JobState.PUBLISHING:
            self._publish(s, job, tenant)
        elif view.event is Event.STARTED and state is JobState.QUEUED:
            apply_event(s, job, Event.STARTED, message=f"Job started on {node or 'a node'}",
                        started_at=job.started_at or utcnow())
        elif view.event is Event.REQUEUED and state is JobState.RUNNING:
            apply_event(s, job, Event.REQUEUED, message="Job requeued by Slurm; it will resume from "
                        "its last checkpoint")
        elif view.event is Event.COMPLETED:
            apply_event(s, job, Event.COMPLETED, message="Training finished; publishing the results")
            self._publish(s, job, tenant)
        elif view.event in (Event.ERROR, Event.STOPPED):
            reason = view.reason or FailReason.INTERNAL
            message = self._trainer_failure(job, tenant) or view.message or "the job failed"
            apply_event(s, job, Event.ERROR, level="error", message=f"Job failed: {message}",
                        error={"code": reason.value, "message": message, "param": None,
                               "reason": reason.value},
                        finished_at=utcnow(), stop_confirmed_at=utcnow(), cleanup="pending")
        return job.status != before

    def _cancelling_step(self, s: Session, job: FineTuningJob, st: JobStatus) -> None:
        if st.source != "missing" and not st.active:
            apply_event(s, job, Event.STOPPED, message="Job cancelled: Slurm confirms no process is left",
                        stop_confirmed_at=utcnow(), finished_at=utcnow(), cleanup="pending")
            return
        self.start_cancel(job.slurm_job_id)

    def start_cancel(self, slurm_id: int | None) -> None:
        """Run ``SlurmClient.cancel`` in a thread, once per Slurm job at a time."""
        if slurm_id is None:
            return
        with self._lock:
            if slurm_id in self._cancelling:
                return
            self._cancelling.add(slurm_id)

        def work() -> None:
            try:
                res = self.client.cancel(slurm_id, deadline_s=self.settings.cancel_deadline_s)
                log.info("Slurm job %s stopped %.2fs after cancel (escalated=%s)", slurm_id, res.seconds,
                         res.escalated)
            except SlurmError as e:
                log.warning("cancel of Slurm job %s: %s", slurm_id, e)
            finally:
                with self._lock:
                    self._cancelling.discard(slurm_id)

        threading.Thread(target=work, name=f"cancel-{slurm_id}", daemon=True).start()

    # -------------------------------------------------------------- events
    def _ingest_events(self, s: Session, job: FineTuningJob, data: bytes) -> None:
        """Apply the complete lines of ``data`` (events.jsonl from the job's offset: written by the
        tenant's job, so untrusted: a line that is not a JSON object is skipped)."""
        end = data.rfind(b"\n")
        if end < 0:
            return
        progress = dict(job.progress or {})
        changes: dict[str, Any] = {}
        for line in data[:end + 1].splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            self._one_event(s, job, ev, progress, changes)
        changes["progress"] = progress
        changes["events_offset"] = job.events_offset + end + 1
        update_fields(s, job, **changes)

    def _one_event(self, s: Session, job: FineTuningJob, ev: dict[str, Any], progress: dict[str, Any],
                   changes: dict[str, Any]) -> None:
        kind = ev.get("type")
        attempt = ev.get("attempt")
        if isinstance(attempt, int) and attempt > changes.get("attempt", job.attempt):
            changes["attempt"] = attempt
            add_event(s, job.id, f"Attempt {attempt} started (requeued run resumes from its checkpoint)")
        if kind == "phase" and ev.get("phase") in PHASES:
            changes["phase"] = PHASES[ev["phase"]]
            add_event(s, job.id, f"Phase: {ev['phase']}", data={"phase": ev["phase"]})
        elif kind == "metrics":
            step, total = ev.get("step"), ev.get("total_steps")
            progress.update({k: ev.get(k) for k in ("step", "total_steps", "loss", "lr", "tokens_per_s",
                                                    "elapsed_s", "epoch")})
            # trained_tokens = tokens of every distinct step (a resumed attempt redoes a few)
            if isinstance(step, int) and isinstance(ev.get("tokens"), int) and step > progress.get("counted_step", 0):
                progress["counted_step"] = step
                changes["trained_tokens"] = changes.get("trained_tokens", job.trained_tokens or 0) + ev["tokens"]
            if isinstance(step, int) and isinstance(total, int) and step > 0 and ev.get("elapsed_s"):
                left = (total - step) * float(ev["elapsed_s"]) / step
                changes["estimated_finish"] = utcnow() + timedelta(seconds=left)
            add_event(s, job.id, f"Step {step}/{total}: training loss={ev.get('loss', 0):.4f}",
                      type_="metrics", data={"step": step, "total_steps": total,
                                             "train_loss": ev.get("loss"),
                                             "tokens_per_s": ev.get("tokens_per_s")})
        elif kind == "eval":
            progress.setdefault("evals", []).append(
                {k: ev.get(k) for k in ("when", "step", "loss", "perplexity", "token_accuracy")})
            add_event(s, job.id, f"Eval ({ev.get('when')}, step {ev.get('step')}): loss={ev.get('loss', 0):.4f}",
                      type_="metrics", data={"step": ev.get("step"), "valid_loss": ev.get("loss"),
                                             "valid_mean_token_accuracy": ev.get("token_accuracy")})
        elif kind == "checkpoint":
            s.add(JobCheckpoint(job_id=job.id, attempt=int(ev.get("attempt") or 0), step=int(ev.get("step") or 0),
                                path=str(ev.get("path", "")),
                                metrics={"train_loss": progress.get("loss"), "step": ev.get("step")}))
            add_event(s, job.id, f"Checkpoint saved at step {ev.get('step')}")
        elif kind == "stopped":
            add_event(s, job.id, f"Trainer stopped by {ev.get('signal')} at step {ev.get('step')} "
                      f"(checkpoint {ev.get('checkpoint_step')})")
        elif kind == "failed":
            progress["failure"] = {"reason": ev.get("reason"), "message": ev.get("message")}

    def _trainer_failure(self, job: FineTuningJob, tenant: Tenant) -> str | None:
        failure = (job.progress or {}).get("failure") or {}
        msg = failure.get("message")
        return f"{msg}" if msg else None

    # ---------------------------------------------------------- publication
    def _publish(self, s: Session, job: FineTuningJob, tenant: Tenant) -> None:
        """Verify and build as the tenant (broker ``publish_build``), record the rows and the
        transition, rename the build dir into place, commit; on any failure remove it again."""
        store = self.storage.tenant(tenant.name)
        try:
            built = store.publish_build(job.id, job.attempt, job.model_digest)
            evaluation = built.get("evaluation")
            refused = publish.eval_gate(evaluation if isinstance(evaluation, dict) else {},
                                        self.settings.eval_gate, self.settings.eval_gate_tolerance)
            if refused:
                store.remove([(layout.ARTIFACTS, built["name"])])
                raise publish.PublishError(refused)
            results = publish.check_results(built.get("results"))
        except (publish.PublishError, Conflict) as e:
            msg = e.message if isinstance(e, Conflict) else str(e)
            apply_event(s, job, Event.ERROR, level="error", message=f"Publication refused: {msg}",
                        error={"code": "publication_refused", "message": msg, "param": None,
                               "reason": FailReason.INTERNAL.value},
                        finished_at=utcnow(), cleanup="pending")
            return
        aid = new_id("art")
        committed = False
        try:
            rows = []
            for name, (size, sha) in results.items():
                row = DataFile(tenant_id=job.tenant_id, filename=f"{job.id}-{name}", purpose="fine-tune-results",
                               bytes=size, sha256=sha, status="processed", path=layout.result_path(aid, name),
                               job_id=job.id)
                s.add(row)
                rows.append(row)
            s.flush()
            apply_event(s, job, Event.PUBLISHED, message="The job has successfully completed",
                        fine_tuned_model=fine_tuned_model_name(job, tenant.name),
                        result_files=[r.id for r in rows], finished_at=utcnow(), cleanup="pending")
            store.publish_commit(built["name"], aid)
            committed = True
            s.commit()
        except BaseException:
            s.rollback()
            try:
                store.remove([(layout.ARTIFACTS, built["name"])] +
                             ([layout.artifact(aid)] if committed else []))
            except ServiceError:
                pass     # the sweep removes a leftover build dir later
            raise

    # -------------------------------------------------------------- cleanup
    def _confirm_cleanups(self, s: Session) -> None:
        from gateway.scrub import ScrubReportError, read_report, report_path

        pending = list(s.exec(select(FineTuningJob).where(FineTuningJob.cleanup == "pending")))
        if self.settings.local:       # no nodes, no scrubber: nothing will ever confirm a cleanup
            for job in pending:
                try:
                    update_fields(s, job, cleanup="off")
                    add_event(s, job.id, "No node cleanup in local mode (no scrubber runs)", level="warn")
                    s.commit()
                except StaleJob:
                    s.rollback()
            return
        for job in pending:
            node = (job.progress or {}).get("node")
            if not node or job.slurm_job_id is None:
                continue
            path = report_path(self.settings.scrub_report_dir, node, job.slurm_job_id, "epilog")
            if not path.exists():
                continue
            try:
                report = read_report(path)
                ok = report.ok
            except ScrubReportError:
                ok = False
            try:
                update_fields(s, job, cleanup="confirmed" if ok else "failed")
                add_event(s, job.id, "Node cleanup confirmed by the epilog" if ok else
                          "Node cleanup FAILED: the node was drained for an administrator",
                          level="info" if ok else "warn")
                s.commit()
            except StaleJob:
                s.rollback()
