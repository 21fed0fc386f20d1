"""Reading a tenant's jobs, events and checkpoints: scoped to the caller's tenant in SQL.

The ORM reads (``get_job``, ``list_jobs``, ...) serve the portal and the services that
change what they read; the Core-row reads (``read_job``, ``read_jobs``, ``read_events``)
serve the API's hot paths.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gateway.access.tokens import Principal
from gateway.errors import Forbidden, NotFound
from gateway.models import FineTuningJob, JobCheckpoint, JobEvent

INTERNAL_PROGRESS = frozenset({"failure", "node", "counted_step", "window", "seen_at", "checkpoint_at", "fired"})
"""``progress`` keys the job object leaves out: the gateway's bookkeeping (the detectors' watch among it)."""


def tenant_id_of(principal: Principal) -> int:
    """The caller's tenant id; Forbidden for a principal without a tenant (staff, admins)."""
    if principal.tenant_id is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    return principal.tenant_id


def get_job(*, session: Session, principal: Principal, job_id: str) -> FineTuningJob:
    """The tenant's job; NotFound for a missing or foreign id alike."""
    tid = tenant_id_of(principal)
    # scoped in SQL: a foreign row is never loaded, so "foreign" costs exactly what "missing" does
    job = session.exec(select(FineTuningJob).where(FineTuningJob.id == job_id, FineTuningJob.tenant_id == tid)
                       ).first() if len(job_id) <= 40 else None
    if job is None:
        raise NotFound(f"no such fine-tuning job: {job_id}", param="fine_tuning_job_id")
    return job


def list_jobs(*, session: Session, principal: Principal, after: str | None, limit: int,
              metadata: dict[str, str] | None = None) -> tuple[list[FineTuningJob], bool]:
    """The tenant's jobs, newest first, after the job ``after`` (NotFound when it is not the tenant's);
    (page, has_more). With ``metadata``, only jobs whose metadata has those values."""
    tid = tenant_id_of(principal)
    q = select(FineTuningJob).where(FineTuningJob.tenant_id == tid)
    if after:
        anchor = session.get(FineTuningJob, after)
        if anchor is None or anchor.tenant_id != tid:
            raise NotFound(f"no such fine-tuning job: {after}", param="after")
        q = q.where(sa.or_(col(FineTuningJob.created_at) < anchor.created_at,
                           sa.and_(col(FineTuningJob.created_at) == anchor.created_at,
                                   col(FineTuningJob.id) < anchor.id)))
    q = q.where(*metadata_filter(metadata or {}))
    q = q.order_by(col(FineTuningJob.created_at).desc(), col(FineTuningJob.id).desc())
    rows = list(session.exec(q.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def metadata_filter(metadata: dict[str, str]) -> list[Any]:
    """SQL conditions for jobs whose ``metadata`` holds each of these string values: a JSON path
    query (SQLite's ``json_extract``, PostgreSQL's ``->>``) run by the database on the tenant's
    page, not a scan of its rows in Python (issue 35)."""
    meta = FineTuningJob.__table__.c.meta  # type: ignore[attr-defined]
    return [meta[key].as_string() == value for key, value in metadata.items()]


# ---------------------------------------------------------------- fast reads
# The API's hot reads (retrieve, list, events) take Core rows of just the columns a job or event object
# shows, on the session's connection: no ORM object, identity map or unit of work per row, and no
# decoding of columns nobody returns (``lineage``, the spec's request hash). ``job_object`` and
# ``event_object`` read a row exactly as they read the model (same attribute names, the same column
# types decode them); tests/service/test_read_paths.py holds the bytes equal to the ORM path's.
_J = FineTuningJob.__table__.c  # type: ignore[attr-defined]
JOB_VIEW = (_J.id, _J.tenant_id, _J.model, _J.parent_model, _J.created_at, _J.finished_at, _J.fine_tuned_model,
            _J.result_files, _J.status, _J.validation_file, _J.training_file, _J.hyperparameters, _J.trained_tokens,
            _J.error, _J.suffix, _J.seed, _J.estimated_finish, _J.expected_start, _J.meta, _J.slurm_job_id,
            _J.attempt, _J.phase, _J.qos, _J.gpus, _J.nodes, _J.fsdp, _J.time_limit_min, _J.cleanup,
            _J.stop_confirmed_at, _J.progress, _J.method, _J.created_by, _J.integrations)
_E = JobEvent.__table__.c  # type: ignore[attr-defined]
EVENT_VIEW = (_E.id, _E.created_at, _E.level, _E.message, _E.data, _E.type)


def _own_job_row(session: Session, tid: int, job_id: str, columns: tuple[Any, ...],
                 param: str = "fine_tuning_job_id") -> Any:
    """``columns`` of the tenant's job ``job_id``; NotFound naming ``param`` for a missing or foreign id
    alike (scoped in SQL: a foreign row is never read)."""
    row = session.connection().execute(sa.select(*columns).where(_J.id == job_id, _J.tenant_id == tid)).first() \
        if len(job_id) <= 40 else None
    if row is None:
        raise NotFound(f"no such fine-tuning job: {job_id}", param=param)
    return row


def read_job(*, session: Session, principal: Principal, job_id: str) -> Any:
    """The tenant's job as a row of JOB_VIEW; NotFound for a missing or foreign id alike."""
    return _own_job_row(session, tenant_id_of(principal), job_id, JOB_VIEW)


def read_jobs(*, session: Session, principal: Principal, after: str | None,
              limit: int, metadata: dict[str, str] | None = None) -> tuple[list[Any], bool]:
    """``list_jobs`` as JOB_VIEW rows: the tenant's jobs, newest first, after the job ``after`` (NotFound
    when it is not the tenant's), with ``metadata`` those whose metadata holds these values (in SQL:
    :func:`metadata_filter`); (page, has_more)."""
    tid = tenant_id_of(principal)
    q = sa.select(*JOB_VIEW).where(_J.tenant_id == tid, *metadata_filter(metadata or {}))
    if after:
        anchor = _own_job_row(session, tid, after, (_J.created_at, _J.id), param="after")
        q = q.where(sa.or_(_J.created_at < anchor.created_at,
                           sa.and_(_J.created_at == anchor.created_at, _J.id < anchor.id)))
    rows = list(session.connection().execute(q.order_by(_J.created_at.desc(), _J.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def read_events(*, session: Session, principal: Principal, job_id: str, after: int | None,
                limit: int) -> tuple[list[Any], bool]:
    """``list_events`` as EVENT_VIEW rows, newest first; NotFound unless the job is the tenant's."""
    _own_job_row(session, tenant_id_of(principal), job_id, (_J.id,))
    q = sa.select(*EVENT_VIEW).where(_E.job_id == job_id)
    if after is not None:
        q = q.where(_E.id < after)
    rows = list(session.connection().execute(q.order_by(_E.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_events(*, session: Session, principal: Principal, job_id: str, after: int | None,
                limit: int) -> tuple[list[JobEvent], bool]:
    """Newest first, like OpenAI's list_events."""
    get_job(session=session, principal=principal, job_id=job_id)
    q = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        q = q.where(col(JobEvent.id) < after)
    rows = list(session.exec(q.order_by(col(JobEvent.id).desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_checkpoints(*, session: Session, principal: Principal, job_id: str) -> list[JobCheckpoint]:
    """The job's checkpoints, highest step first; NotFound for a job that is not the tenant's."""
    get_job(session=session, principal=principal, job_id=job_id)
    q = select(JobCheckpoint).where(JobCheckpoint.job_id == job_id)
    return list(session.exec(q.order_by(col(JobCheckpoint.step).desc())))
