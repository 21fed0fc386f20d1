"""Retention: what the sweeper deletes, and the writes that record each deletion.

What goes, and when (``plan``, pure):

- a file uploaded with ``expires_after``, once its ``expires_at`` has passed;
- a succeeded job's training state (``layout.training_state``: checkpoint dirs with their optimizer
  state, the attempts' staging), soon after publication: the checkpoints it keeps (the final one, the
  best eval's, the ``keep_checkpoints`` newest: the trainer pruned the others while training) are
  published tars by then, the job's models; the event says which steps stay and what was freed;
- under the tenant's retention policy (``Tenant.retention``: days to keep per kind, set with
  ``finetune admin tenant retention``; a kind not set is kept forever): ``datasets`` (uploaded files)
  and ``results`` (a job's adapter.tar, eval.json, metrics.csv) older than that, ``checkpoints`` (the
  published checkpoint tars, by when they were published, and the training state of a job that failed or
  was cancelled, by when it ended), ``logs`` (a finished job's events.jsonl and Slurm output file).

Never a file that a job which has not ended uses (its training, validation or init file), nor the state
of a job that has not ended: such a file waits and goes on the first pass after that job ends. Identical
uploads share their bytes (``services.files``): a row goes, its bytes only with the last live row.

``sweep_pass`` carries a plan out, bounded (``sweep_max_items`` deletions, ``sweep_budget_s`` seconds):
each deletion removes the bytes through the storage broker as the tenant (``TenantStorage.free``), then
records it in a short transaction of its own: the row marked deleted, an audit entry in the tenant's log
(``/v1/audit``), and a job event for what belongs to a job. The bytes go first and outside any
transaction (a large checkpoint tree must not hold the database's write lock); a pass that dies between
the two finds the row still due and finishes it next time (a removal of what is gone is a no-op).
The leader runs passes in a thread of their own (``gateway.jobs.sweeper``), never inside a reconcile cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gateway.access import audit
from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, Role, Tenant, utcnow
from gateway.services.files import file_parts
from gateway.services.jobwrites import StaleJob, add_event, update_fields
from gateway.state import ACTIVE, TERMINAL, JobState
from gateway.storage import Storage, layout

log = logging.getLogger(__name__)

DATASETS = "datasets"
RESULTS = "results"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
KINDS = (DATASETS, RESULTS, CHECKPOINTS, LOGS)
"""What a retention policy names, each with the days to keep it."""
MAX_DAYS = 36_600
ACTOR = audit.Actor(None, "system", "retention sweeper")
ACTIVE_STATES = tuple(s.value for s in ACTIVE)
TERMINAL_STATES = tuple(s.value for s in TERMINAL)
FOREVER = ("0", "off", "none", "forever")


class Fence(Protocol):
    """The leader's lease (``gateway.jobs.leader.Lease``): a deposed leader deletes nothing."""

    def guard(self, session: Session) -> None:
        """Fence ``session``: its commits fail (nothing written) once another process leads."""

    def check(self, session: Session | None = None) -> None:
        """Renew now; raises (the lease's own exception) when another process leads."""


# ------------------------------------------------------------------ the policy
def policy_of(raw: Any) -> dict[str, int]:
    """A tenant's stored policy as {kind: days to keep}, only valid kinds with 1..MAX_DAYS days (the
    rest: kept forever)."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if k in KINDS and isinstance(v, int) and not isinstance(v, bool)
            and 1 <= v <= MAX_DAYS}


def parse_days(value: str, kind: str) -> int | None:
    """``value`` as days to keep ``kind``: None (forever) for 0/off/none/forever, else 1..MAX_DAYS.
    ServiceError naming the kind for anything else."""
    text = value.strip().lower()
    if text in FOREVER:
        return None
    if text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_DAYS:
        return int(text)
    raise ServiceError(f"--{kind}: give the days to keep (1 to {MAX_DAYS}), or 0/off to keep forever; "
                       f"not {value!r}", param=kind)


def retention_object(tenant: Tenant) -> dict[str, Any]:
    """What the CLI shows: the tenant and its days to keep per kind (None: forever)."""
    policy = policy_of(tenant.retention)
    return {"tenant": tenant.name, "retention": {k: policy.get(k) for k in KINDS}}


def set_retention(*, session: Session, tenant: Tenant, by: str, changes: Mapping[str, int | None]) -> Tenant:
    """Set ``tenant``'s days to keep for the kinds in ``changes`` (None: forever), audited in its log as
    ``tenant.retention`` by ``by``. ServiceError for an unknown kind or days out of range."""
    policy = policy_of(tenant.retention)
    said = []
    for kind, days in changes.items():
        if kind not in KINDS or (days is not None and not 1 <= days <= MAX_DAYS):
            raise ServiceError(f"retention {kind}={days!r}: kinds are {', '.join(KINDS)}, days 1 to {MAX_DAYS}")
        if days is None:
            policy.pop(kind, None)
        else:
            policy[kind] = days
        said.append(f"{kind} {'forever' if days is None else f'{days} days'}")
    if not said:
        return tenant
    tenant.retention = dict(policy) or None      # a new object: the JSON column sees the change
    session.add(tenant)
    audit.append(session, at=utcnow(), actor=audit.Actor(None, Role.SYSADMIN.value, by), action="tenant.retention",
                 outcome=audit.ALLOWED, tenant=tenant.name, reason="; ".join(said))
    return tenant


# --------------------------------------------------------------- the decisions
@dataclass(frozen=True)
class FileFacts:
    """What the decision needs of a live file row."""

    id: str
    tenant: str
    kind: str                   # datasets | results | checkpoints
    created_at: datetime
    expires_at: datetime | None = None


@dataclass(frozen=True)
class JobFacts:
    """What the decision needs of a job row; ``done``: what the sweeper already did to it (``DONE``)."""

    id: str
    tenant: str
    status: str
    finished_at: datetime | None
    done: frozenset[str] = frozenset()


DONE = ("pruned_at", "checkpoints_at", "logs_at")
"""The keys of ``progress.storage`` that say the sweeper pruned the job, removed its checkpoints, its logs."""


@dataclass(frozen=True)
class Task:
    """One deletion: ``what`` is ``file`` (the row and, unless shared, its bytes), ``prune`` (a succeeded
    job's training state), ``checkpoints`` or ``logs`` (an ended job's); ``reason``: ``expired``,
    ``published`` or ``retention``; ``days``: the policy's, for a retention task."""

    what: str
    tenant: str
    id: str
    reason: str
    days: int | None = None


@dataclass
class Plan:
    tasks: list[Task] = field(default_factory=list)
    held: list[Task] = field(default_factory=list)      # due, but a job that has not ended uses the file


def file_kind(path: str | None) -> str:
    """A file row's retention kind by its ``path``: ``datasets`` (none), ``checkpoints`` (a checkpoint's
    adapter tar) or ``results``."""
    if path is None:
        return DATASETS
    try:
        name = layout.result_file(path)[-1]
    except layout.LayoutError:
        return RESULTS
    return CHECKPOINTS if layout.checkpoint_step_of(name) is not None else RESULTS


def file_task(f: FileFacts, policy: Mapping[str, int], now: datetime) -> Task | None:
    """The deletion of ``f`` when it is due at ``now`` (expired, or older than its kind's days), else None."""
    if f.expires_at is not None and f.expires_at <= now:
        return Task("file", f.tenant, f.id, "expired")
    days = policy.get(f.kind)
    if days and f.created_at <= now - timedelta(days=days):
        return Task("file", f.tenant, f.id, "retention", days)
    return None


def file_due(session: Session, row: DataFile, now: datetime) -> str | None:
    """Why file ``row`` is due for deletion at ``now`` (expired, or older than its tenant's policy allows),
    else None: such a file starts no job (the sweeper deletes it on its next pass)."""
    tenant = session.get(Tenant, row.tenant_id)
    policy = policy_of(tenant.retention) if tenant is not None else {}
    task = file_task(FileFacts(row.id, "", file_kind(row.path), row.created_at, row.expires_at), policy, now)
    return _why(task, row.expires_at) if task is not None else None


def job_tasks(j: JobFacts, policy: Mapping[str, int], now: datetime) -> list[Task]:
    """What is due of job ``j`` at ``now``: nothing while it has not ended; a succeeded job's prune once;
    an ended job's checkpoints (one that did not succeed: a succeeded one's are published files) and logs
    once older than the policy's days."""
    if j.status not in TERMINAL_STATES or j.finished_at is None:
        return []
    out = []
    if j.status == JobState.SUCCEEDED and "pruned_at" not in j.done:
        out.append(Task("prune", j.tenant, j.id, "published"))
    for kind, key, applies in ((CHECKPOINTS, "checkpoints_at", j.status != JobState.SUCCEEDED),
                               (LOGS, "logs_at", True)):
        days = policy.get(kind)
        if applies and days and key not in j.done and j.finished_at <= now - timedelta(days=days):
            out.append(Task(kind, j.tenant, j.id, "retention", days))
    return out


def plan(files: Iterable[FileFacts], jobs: Iterable[JobFacts], policies: Mapping[str, Mapping[str, int]],
         in_use: set[str], now: datetime, limit: int) -> Plan:
    """The deletions due at ``now``, at most ``limit``: succeeded jobs' prunes first (the most space),
    then expired files, files past the policy, ended jobs' checkpoints and logs. A due file in
    ``in_use`` (named by a job that has not ended) is held instead."""
    out = Plan()
    due: list[Task] = []
    for j in jobs:
        due += job_tasks(j, policies.get(j.tenant, {}), now)
    for f in files:
        task = file_task(f, policies.get(f.tenant, {}), now)
        if task is not None:
            (out.held if f.id in in_use else due).append(task)
    rank = {("prune", "published"): 0, ("file", "expired"): 1, ("file", "retention"): 2,
            (CHECKPOINTS, "retention"): 3, (LOGS, "retention"): 4}
    out.tasks = sorted(due, key=lambda t: rank[(t.what, t.reason)])[:limit]
    return out


# ----------------------------------------------------------------- the reads
def _storage_done(progress: Any) -> frozenset[str]:
    storage = (progress or {}).get("storage") if isinstance(progress, dict) else None
    return frozenset(k for k in DONE if isinstance(storage, dict) and storage.get(k))


def _not_done(key: str) -> Any:
    """SQL: the job's ``progress.storage.<key>`` is not set (JSON path; SQLite and PostgreSQL alike)."""
    return col(FineTuningJob.progress)[("storage", key)].as_string().is_(None)


def in_use(session: Session) -> set[str]:
    """The files that jobs which have not ended name (training, validation, init file)."""
    rows = session.exec(select(FineTuningJob.training_file, FineTuningJob.validation_file, FineTuningJob.init_file)
                        .where(col(FineTuningJob.status).in_(ACTIVE_STATES)))
    return {f for row in rows for f in row if f}


def _used_by(session: Session, file_id: str) -> str | None:
    """A job that has not ended and names file ``file_id`` (training, validation or init file), or None."""
    return session.exec(select(FineTuningJob.id).where(
        (FineTuningJob.training_file == file_id) | (FineTuningJob.validation_file == file_id)
        | (FineTuningJob.init_file == file_id), col(FineTuningJob.status).in_(ACTIVE_STATES))).first()


def _published_steps(session: Session, job_id: str) -> list[int]:
    """The steps of the checkpoints ``job_id``'s publication packed as tars (its models), ascending."""
    steps = set()
    for path in session.exec(select(DataFile.path).where(DataFile.job_id == job_id, col(DataFile.path).is_not(None))):
        try:
            step = layout.checkpoint_step_of(layout.result_file(path or "")[-1])
        except layout.LayoutError:
            continue
        if step is not None:
            steps.add(step)
    return sorted(steps)


def _file_facts(rows: Iterable[DataFile], names: Mapping[int, str]) -> list[FileFacts]:
    return [FileFacts(r.id, names[r.tenant_id], file_kind(r.path), r.created_at, r.expires_at)
            for r in rows if r.tenant_id in names]


def _job_facts(rows: Iterable[FineTuningJob], names: Mapping[int, str]) -> list[JobFacts]:
    return [JobFacts(j.id, names[j.tenant_id], j.status, j.finished_at, _storage_done(j.progress))
            for j in rows if j.tenant_id in names]


def candidates(session: Session, now: datetime, limit: int
               ) -> tuple[list[FileFacts], list[JobFacts], dict[str, dict[str, int]], set[str]]:
    """What ``plan`` weighs: (files, jobs, policies by tenant, files in use), each query bounded by
    ``limit`` (plus the files held in use, so held ones never crowd out the rest)."""
    tenants = list(session.exec(select(Tenant)))
    names = {t.id: t.name for t in tenants if t.id is not None}
    policies = {t.name: policy_of(t.retention) for t in tenants}
    busy = in_use(session)
    room = limit + len(busy)
    live = col(DataFile.deleted_at).is_(None)
    files = _file_facts(session.exec(select(DataFile).where(live, col(DataFile.expires_at) <= now)
                                     .order_by(col(DataFile.expires_at)).limit(room)), names)
    jobs = _job_facts(session.exec(select(FineTuningJob).where(
        FineTuningJob.status == JobState.SUCCEEDED.value, col(FineTuningJob.finished_at).is_not(None),
        _not_done("pruned_at"))
        .order_by(col(FineTuningJob.finished_at)).limit(limit)), names)
    for t in tenants:
        policy = policies[t.name]
        for kind in (DATASETS, RESULTS, CHECKPOINTS):
            if kind not in policy:
                continue
            q = select(DataFile).where(live, DataFile.tenant_id == t.id,
                                       col(DataFile.created_at) <= now - timedelta(days=policy[kind]))
            path = col(DataFile.path)
            q = q.where(path.is_(None) if kind == DATASETS else path.is_not(None))
            files += [f for f in _file_facts(session.exec(q.order_by(col(DataFile.created_at)).limit(room)), names)
                      if f.kind == kind]
        for kind, key in ((CHECKPOINTS, "checkpoints_at"), (LOGS, "logs_at")):
            if kind in policy:
                cutoff = now - timedelta(days=policy[kind])
                ended = select(FineTuningJob).where(FineTuningJob.tenant_id == t.id,
                                                    col(FineTuningJob.status).in_(TERMINAL_STATES),
                                                    col(FineTuningJob.finished_at) <= cutoff, _not_done(key))
                jobs += _job_facts(session.exec(ended.order_by(col(FineTuningJob.finished_at)).limit(limit)), names)
    return list({f.id: f for f in files}.values()), list({j.id: j for j in jobs}.values()), policies, busy


# ------------------------------------------------------------------ the pass
@dataclass
class SweepReport:
    """What one pass did: deletions by what they were, bytes freed, files held for a job that has not
    ended, failures, seconds, and why it stopped early (``limit``, ``budget``, ``lease``) if it did."""

    deleted: dict[str, int] = field(default_factory=dict)
    freed_bytes: int = 0
    held: int = 0
    errors: int = 0
    seconds: float = 0.0
    stopped: str | None = None
    tasks: list[Task] = field(default_factory=list)      # a dry run's plan

    @property
    def count(self) -> int:
        """Deletions carried out in all."""
        return sum(self.deleted.values())

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-able data (the CLI's ``--json``)."""
        return {"deleted": self.deleted, "count": self.count, "freed_bytes": self.freed_bytes, "held": self.held,
                "errors": self.errors, "seconds": round(self.seconds, 3), "stopped": self.stopped,
                "tasks": [asdict(t) for t in self.tasks]}


def sweep_pass(engine: Engine, settings: Settings, *, storage: Storage, fence: Fence | None = None,
               lost: tuple[type[BaseException], ...] = (), now: datetime | None = None, dry_run: bool = False,
               limit: int | None = None, budget_s: float | None = None) -> SweepReport:
    """One bounded pass: plan what is due at ``now`` (at most ``limit``, default ``sweep_max_items``) and
    delete it, stopping once ``budget_s`` (default ``sweep_budget_s``) has passed; ``dry_run`` only plans
    (``tasks``). With ``fence`` (the leader's lease) a deposed leader deletes nothing more: the fence's
    ``lost`` exceptions stop the pass (``stopped: lease``). Returns the report; any other failure of a
    deletion is logged, counted and left for a later pass."""
    t0 = time.monotonic()
    now = now or utcnow()
    limit = settings.sweep_max_items if limit is None else limit
    budget = settings.sweep_budget_s if budget_s is None else budget_s
    with Session(engine) as s:
        files, jobs, policies, busy = candidates(s, now, limit)
    p = plan(files, jobs, policies, busy, now, limit)
    report = SweepReport(held=len(p.held))
    if dry_run:
        report.tasks = p.tasks
    else:
        _carry_out(engine, storage, fence, lost, p.tasks, now, report, t0 + budget)
        if report.stopped is None and len(p.tasks) >= limit:
            report.stopped = "limit"
    report.seconds = time.monotonic() - t0
    if report.count or report.errors:
        log.info("retention sweep: %d deleted (%s), %d bytes freed, %d held for jobs not ended, %d failed, "
                 "%.2fs%s", report.count, ", ".join(f"{k} {n}" for k, n in sorted(report.deleted.items())),
                 report.freed_bytes, report.held, report.errors, report.seconds,
                 f" (stopped: {report.stopped})" if report.stopped else "")
    return report


def _carry_out(engine: Engine, storage: Storage, fence: Fence | None, lost: tuple[type[BaseException], ...],
               tasks: list[Task], now: datetime, report: SweepReport, deadline: float) -> None:
    for task in tasks:
        if time.monotonic() >= deadline:
            report.stopped = "budget"
            return
        try:
            freed = DO[task.what](engine, storage, fence, task, now)
        except StaleJob:
            continue                       # the job changed meanwhile: decided again next pass
        except lost:
            report.stopped = "lease"
            return
        except Exception as e:  # noqa: BLE001 - one deletion's failure never stops the pass
            report.errors += 1
            log.warning("retention sweep: %s %s of tenant %s failed (%s: %s); retried next pass", task.what,
                        task.id, task.tenant, type(e).__name__, e)
            continue
        if freed is not None:
            report.deleted[task.what] = report.deleted.get(task.what, 0) + 1
            report.freed_bytes += freed


def _session(engine: Engine, fence: Fence | None) -> Session:
    s = Session(engine, expire_on_commit=False)
    if fence is not None:
        fence.guard(s)
    return s


def _before_removing(fence: Fence | None) -> None:
    if fence is not None:
        fence.check()        # the broker deletes next: only the leader may


def _why(task: Task, when: datetime | None = None) -> str:
    if task.reason == "expired":
        return f"expired at {when.isoformat(timespec='seconds')}" if when else "expired"
    if task.reason == "published":
        return "the job succeeded: only the checkpoints it keeps stay"
    return f"older than the tenant's retention of {task.days} days"


def _delete_file(engine: Engine, storage: Storage, fence: Fence | None, task: Task, now: datetime) -> int | None:
    """The file row ``task.id`` marked deleted and its bytes removed unless another live row shares them;
    the bytes freed, or None when it was not deleted (gone already, or a job that has not ended uses it)."""
    with Session(engine) as s:
        row = s.get(DataFile, task.id)
        if row is None or row.deleted_at is not None:
            return None
        if _used_by(s, task.id) is not None:
            return None            # a job created meanwhile: held, decided again next pass
        shared = row.path is None and s.exec(select(DataFile.id).where(
            DataFile.tenant_id == row.tenant_id, DataFile.sha256 == row.sha256, col(DataFile.path).is_(None),
            col(DataFile.deleted_at).is_(None), DataFile.id != row.id)).first() is not None
        parts, expires_at, job_id = file_parts(row), row.expires_at, row.job_id
    store = storage.tenant(task.tenant)
    freed = 0
    if not shared:
        _before_removing(fence)
        freed = store.free([parts]).bytes or 0
    with _session(engine, fence) as s:
        row = s.get(DataFile, task.id)
        if row is None or row.deleted_at is not None:
            return None
        row.deleted_at = now
        s.add(row)
        kind = file_kind(row.path)
        action = "file.expire" if task.reason == "expired" else "file.retention"
        audit.append(s, at=utcnow(), actor=ACTOR, action=action, outcome=audit.ALLOWED, tenant=task.tenant,
                     resource=task.id,
                     reason=f"{kind} file {row.filename!r} deleted: {_why(task, expires_at)}; "
                            + ("its bytes stay for an identical live upload" if shared else f"{freed} bytes freed"))
        if job_id is not None:
            add_event(s, job_id, f"Result file {row.filename} deleted ({_why(task)})", data={
                "retention": kind, "file": task.id, "freed_bytes": freed})
        s.commit()
        rest = _artifact_left(s, row) if row.path else None
    if rest is not None and not rest:
        store.free([parts[:2]])             # the last result of artifacts/<art id>/: the dir goes too
    log.info("tenant %s: file %s deleted (%s), %d bytes freed", task.tenant, task.id, _why(task, expires_at), freed)
    return freed


def _artifact_left(session: Session, row: DataFile) -> list[str]:
    """The live result files that share ``row``'s artifacts/<art id>/ dir."""
    parts = file_parts(row)[:2]
    others = session.exec(select(DataFile).where(DataFile.job_id == row.job_id, DataFile.tenant_id == row.tenant_id,
                                                 col(DataFile.path).is_not(None), col(DataFile.deleted_at).is_(None)))
    return [f.id for f in others if file_parts(f)[:2] == parts]


def _job_step(engine: Engine, storage: Storage, fence: Fence | None, task: Task, now: datetime) -> int | None:
    """Remove what ``task`` names of an ended job (``prune``/``checkpoints``: its training state; ``logs``:
    its logs), then record it: ``progress.storage`` (so it is done once, with the bytes freed), a job event
    and an audit entry. Returns the bytes freed, None when the job is no longer due."""
    key = {"prune": "pruned_at", CHECKPOINTS: "checkpoints_at", LOGS: "logs_at"}[task.what]
    with Session(engine) as s:
        job = s.get(FineTuningJob, task.id)
        if job is None or job.status not in TERMINAL_STATES or key in _storage_done(job.progress):
            return None
        paths = layout.job_logs(job.id, job.slurm_job_id) if task.what == LOGS else layout.training_state(job.id)
        kept = _published_steps(s, job.id) if task.what == "prune" else []
        recorded = set(s.exec(select(JobCheckpoint.step).where(JobCheckpoint.job_id == job.id).distinct()))
    _before_removing(fence)
    freed = storage.tenant(task.tenant).free(paths).bytes or 0
    with _session(engine, fence) as s:
        job = s.get(FineTuningJob, task.id)
        if job is None or key in _storage_done(job.progress):
            return None
        progress = dict(job.progress or {})
        storage_rec = dict(progress.get("storage") or {})
        storage_rec[key] = now.isoformat(timespec="seconds")
        storage_rec["freed_bytes"] = int(storage_rec.get("freed_bytes") or 0) + freed
        data: dict[str, Any] = {"freed_bytes": freed}
        if task.what == "prune":
            removed = sorted(recorded - set(kept))
            trainer = (progress.get("checkpoints_pruned") or {}).get("bytes")
            data = {"kept_steps": kept, "removed_steps": removed, "freed_bytes": freed,
                    "trainer_pruned_bytes": trainer if isinstance(trainer, int) else None}
            storage_rec.update(kept_steps=kept, removed_steps=removed)
            message = (f"Training state removed ({freed} bytes freed): the checkpoints of steps "
                       f"{_steps(kept)} stay, as models; {_steps(removed)} are gone")
        else:
            message = (f"{'Checkpoints' if task.what == CHECKPOINTS else 'Logs'} removed, {_why(task)} "
                       f"({freed} bytes freed)")
            data["retention"] = task.what
        progress["storage"] = storage_rec
        update_fields(s, job, progress=progress)
        add_event(s, job.id, message, data=data)
        audit.append(s, at=utcnow(), actor=ACTOR, action=f"job.{task.what}", outcome=audit.ALLOWED,
                     tenant=task.tenant, resource=job.id, reason=f"{message}; {_why(task)}")
        s.commit()
    log.info("tenant %s: job %s: %s", task.tenant, task.id, message)
    return freed


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


DO = {"file": _delete_file, "prune": _job_step, CHECKPOINTS: _job_step, LOGS: _job_step}
