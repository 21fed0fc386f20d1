"""Staff access: requests, tenant-admin decisions, grant-checked reads, metadata views, audit.

Staff and sysadmin tokens ("operators") never read tenant content through tenant
routes. They read one resource only while a tenant admin's approval of their own
request for exactly that resource is inside its window; ``check_grant`` decides at
every request, from the database, with the app's clock. Every decision (allowed or
not) and every request, approval, denial and revocation goes to the audit log.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gateway.access import audit
from gateway.access.policy import (
    OPERATOR_ROLES,
    AccessError,
    RequestStatus,
    decide,
    grant_views,
    parse_duration,
    parse_resource,
    request_state,
)
from gateway.access.tokens import Principal, actor, decide_refusal
from gateway.errors import Conflict, Forbidden, NotFound, ServiceError
from gateway.models import AccessRequest, ApiToken, AuditEntry, DataFile, FineTuningJob, JobEvent, Role, Tenant

Clock = Callable[[Any], datetime]


def db_now(db: Any) -> datetime:
    """The database's current time (UTC-aware): one clock for every gateway sharing the DB."""
    if db.get_bind().dialect.name == "sqlite":
        raw = db.execute(sa.text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
        return datetime.fromisoformat(raw).replace(tzinfo=UTC)
    value: datetime = db.execute(sa.text("SELECT CURRENT_TIMESTAMP")).scalar_one()
    return value.astimezone(UTC)


def _operator(principal: Principal) -> None:
    if principal.role not in OPERATOR_ROLES:
        raise Forbidden("only staff and sysadmin tokens make access requests")


def _tenant_admin(principal: Principal) -> int:
    if principal.role is not Role.TENANT_ADMIN or principal.tenant_id is None:
        raise Forbidden("only your tenant's admin (role tenant_admin) approves, denies or revokes access")
    return principal.tenant_id


def _tenant_of(session: Session, tenant_id: int | None) -> str | None:
    tenant = session.get(Tenant, tenant_id) if tenant_id is not None else None
    return tenant.name if tenant else None


def find_resource(session: Session, kind: str, rid: str) -> DataFile | FineTuningJob | None:
    """The live job or file ``rid`` (any tenant), or None."""
    if len(rid) > 40:
        return None
    if kind == "job":
        return session.get(FineTuningJob, rid)
    row = session.get(DataFile, rid)
    return row if row is not None and row.deleted_at is None else None


# ------------------------------------------------------------------- requests
def request_access(*, session: Session, principal: Principal, tenant: str, resource: str, reason: str,
                   duration: str | int, now: datetime) -> AccessRequest:
    """A pending request by an operator for one resource of ``tenant``; audited.

    Raises ServiceError on bad input, NotFound when the tenant has no such resource.
    """
    _operator(principal)
    try:
        kind, rid = parse_resource(resource)
        seconds = parse_duration(duration)
    except AccessError as e:
        raise ServiceError(str(e), param="resource" if "resource" in str(e) else "duration") from e
    if not reason.strip():
        raise ServiceError("reason: say why you need access (the tenant's admin reads it)", param="reason")
    row_t = session.exec(select(Tenant).where(Tenant.name == tenant)).first()
    target = find_resource(session, kind, rid)
    if row_t is None or target is None or target.tenant_id != row_t.id:
        raise NotFound(f"tenant {tenant!r} has no {kind} {rid}", param="resource")
    assert row_t.id is not None
    req = AccessRequest(tenant_id=row_t.id, requester_token_id=principal.token_id,
                        requester_role=principal.role.value, resource_kind=kind, resource_id=rid,
                        reason=reason.strip()[:1000], duration_s=seconds, created_at=now)
    session.add(req)
    session.flush()
    audit.append(session, at=now, actor=actor(principal), action="access.request", outcome=audit.ALLOWED,
                 tenant=tenant, resource=f"{kind}:{rid}", grant_id=req.id,
                 reason=f"for {seconds}s: {req.reason}")
    return req


def list_own_requests(*, session: Session, principal: Principal) -> list[AccessRequest]:
    """The access requests this operator token made, newest first; Forbidden for a non-operator."""
    _operator(principal)
    q = select(AccessRequest).where(AccessRequest.requester_token_id == principal.token_id)
    return list(session.exec(q.order_by(col(AccessRequest.created_at).desc())))


def tenant_names(*, session: Session, ids: set[int]) -> dict[int, str]:
    """Tenant id → name for these ids (unknown ids are left out)."""
    if not ids:
        return {}
    return {t.id: t.name for t in session.exec(select(Tenant).where(col(Tenant.id).in_(ids))) if t.id is not None}


def list_tenant_requests(*, session: Session, principal: Principal) -> list[AccessRequest]:
    """Every request for the caller's tenant, newest first (members see them too)."""
    if principal.tenant_id is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    q = select(AccessRequest).where(AccessRequest.tenant_id == principal.tenant_id)
    return list(session.exec(q.order_by(col(AccessRequest.created_at).desc())))


def decide_request(*, session: Session, principal: Principal, request_id: str, action: str,
                   now: datetime) -> AccessRequest:
    """approve | deny a pending request, or revoke an active grant; audited.

    Raises NotFound (not this tenant's), Conflict (wrong state), Forbidden (not tenant_admin,
    or a tenant_admin token an operator minted: that refusal is audited).
    """
    tid = _tenant_admin(principal)
    if action not in ("approve", "deny", "revoke"):
        raise ServiceError(f"action {action!r}: expected approve, deny or revoke", param="action")
    req = session.get(AccessRequest, request_id) if len(request_id) <= 40 else None
    if req is None or req.tenant_id != tid:
        raise NotFound(f"no such access request: {request_id}", param="request_id")
    refusal = decide_refusal(session=session, principal=principal)
    if refusal is not None:
        # Committed on its own: the refusal stays in the tenant's log although the request fails.
        audit.append_now(session.get_bind().engine, at=now, actor=actor(principal), action=f"access.{action}",
                         outcome=audit.DENIED, tenant=principal.tenant_name,
                         resource=f"{req.resource_kind}:{req.resource_id}", grant_id=req.id,
                         reason=f"decision refused: {refusal}")
        raise Forbidden(refusal)
    state = request_state(grant_views([req])[0], now)
    if action in ("approve", "deny"):
        if state != RequestStatus.PENDING:
            raise Conflict(f"access request {request_id} is {state}: only pending requests can be {action}d")
        req.status = RequestStatus.APPROVED if action == "approve" else RequestStatus.DENIED
        req.decided_at, req.decided_by_token_id = now, principal.token_id
        if action == "approve":
            req.expires_at = now + timedelta(seconds=req.duration_s)
    else:
        if state != "active":
            raise Conflict(f"access request {request_id} is {state}: only an active grant can be revoked")
        req.status, req.revoked_at, req.revoked_by_token_id = RequestStatus.REVOKED, now, principal.token_id
    session.add(req)
    session.flush()
    note = f"expires {req.expires_at.isoformat()}" if req.expires_at and action == "approve" else ""
    audit.append(session, at=now, actor=actor(principal), action=f"access.{action}", outcome=audit.ALLOWED,
                 tenant=principal.tenant_name, resource=f"{req.resource_kind}:{req.resource_id}",
                 grant_id=req.id, reason=note)
    return req


def request_object(req: AccessRequest, tenant: str | None, now: datetime,
                   session: Session | None = None) -> dict[str, Any]:
    """The API shape of a request, with its state now (pending, active, expired, ...) and, given a
    ``session``, who decided it: the deciding token's name (a person's: "bob via munge")."""
    def ts(dt: datetime | None) -> int | None:
        return int(dt.timestamp()) if dt else None

    def who(token_id: int | None) -> str | None:
        row = session.get(ApiToken, token_id) if session is not None and token_id is not None else None
        return (row.name or f"token #{row.id}") if row is not None else None

    return {"object": "access_request", "id": req.id, "tenant": tenant,
            "resource": f"{req.resource_kind}:{req.resource_id}", "reason": req.reason,
            "duration_s": req.duration_s, "status": req.status,
            "state": request_state(grant_views([req])[0], now), "requested_by_token": req.requester_token_id,
            "requested_by_role": req.requester_role, "created_at": ts(req.created_at),
            "decided_at": ts(req.decided_at), "expires_at": ts(req.expires_at), "revoked_at": ts(req.revoked_at),
            "decided_by": who(req.decided_by_token_id), "revoked_by": who(req.revoked_by_token_id)}


# ---------------------------------------------------------------- grant checks
def check_grant(*, session: Session, engine: Engine, principal: Principal, kind: str, rid: str, action: str,
                now: datetime) -> tuple[str, DataFile | FineTuningJob]:
    """(tenant name, the row) when the caller holds an active grant for exactly ``kind:rid``.

    The decision is appended to the audit log, committed, before this returns or raises:
    Forbidden (no usable grant) or NotFound (no such resource).
    """
    _operator(principal)
    resource = f"{kind}:{rid}"
    target = find_resource(session, kind, rid)
    tenant = _tenant_of(session, target.tenant_id) if target is not None else None
    if target is None:
        audit.append_now(engine, at=now, actor=actor(principal), action=action, outcome=audit.DENIED,
                         resource=resource[:60], reason="no such resource")
        raise NotFound(f"no such {kind}: {rid}", param=f"{kind}_id")
    mine = session.exec(select(AccessRequest).where(
        AccessRequest.requester_token_id == principal.token_id, AccessRequest.tenant_id == target.tenant_id,
        AccessRequest.resource_kind == kind, AccessRequest.resource_id == rid)).all()
    verdict = decide(grant_views(mine), now, resource)
    audit.append_now(engine, at=now, actor=actor(principal), action=action,
                     outcome=audit.ALLOWED if verdict.allowed else audit.DENIED, tenant=tenant,
                     resource=resource, grant_id=verdict.grant_id, reason=verdict.reason)
    if not verdict.allowed:
        raise Forbidden(f"{verdict.reason}: ask with `finetune staff request --tenant {tenant} "
                        f"--resource {resource}` and wait for the tenant admin's approval")
    assert tenant is not None
    return tenant, target


def job_result_file(*, session: Session, job: FineTuningJob, file_id: str) -> DataFile:
    """A published result file of ``job``; NotFound for anything else (datasets included)."""
    row = session.get(DataFile, file_id) if len(file_id) <= 40 else None
    if row is None or row.deleted_at is not None or row.job_id != job.id or row.tenant_id != job.tenant_id \
            or file_id not in (job.result_files or []):
        raise NotFound(f"job {job.id} has no result file {file_id}", param="file_id")
    return row


def job_events(*, session: Session, job: FineTuningJob, limit: int) -> list[JobEvent]:
    """The job's newest ``limit`` events, newest first (the caller has checked the grant)."""
    q = select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id).desc()).limit(limit)
    return list(session.exec(q))


def record_refusal(engine: Engine, *, now: datetime, principal: Principal, path_params: Mapping[str, Any],
                   route: str) -> None:
    """Audit an operator refused by a tenant route, naming the resource when the path has one."""
    kind, rid = next(((k.removesuffix("_id"), str(v)) for k, v in path_params.items()
                      if k in ("job_id", "file_id")), (None, None))
    tenant = None
    if kind and rid:
        with Session(engine) as s:
            target = find_resource(s, kind, rid)
            tenant = _tenant_of(s, target.tenant_id) if target is not None else None
    audit.append_now(engine, at=now, actor=actor(principal), action="tenant_route", outcome=audit.DENIED,
                     tenant=tenant, resource=f"{kind}:{rid}"[:60] if kind else None,
                     reason=f"{route[:200]}: tenant routes refuse {principal.role.value} tokens")


_RESOURCE_PARAMS = {"job_id": "job", "file_id": "file", "sweep_id": "sweep"}


def _read_resource(principal: Principal, path_params: Mapping[str, Any]) -> str | None:
    """``kind:id`` of the job, file or sweep a read names, or of a model of the caller's own tenant
    (a model id is free text: another tenant's is not echoed into this tenant's log)."""
    for k, kind in _RESOURCE_PARAMS.items():
        if k in path_params:
            return f"{kind}:{path_params[k]}"[:60]
    model = str(path_params.get("model_id", ""))
    return f"model:{model}"[:60] if model and f":{principal.tenant_name}:" in model else None


READ_AUDIT_WINDOW_S = 600.0
"""A read with an operator-minted token is audited once per token, action and resource in this window."""
_READS_SEEN: OrderedDict[tuple[str, int, str, str | None], float] = OrderedDict()
_READS_LOCK = threading.Lock()
_READS_MAX = 50_000


def _first_read_in_window(key: tuple[str, int, str, str | None], now_s: float) -> bool:
    """Whether ``key`` has not been audited by this process within READ_AUDIT_WINDOW_S (and note it)."""
    with _READS_LOCK:
        seen = _READS_SEEN.get(key)
        if seen is not None and now_s - seen < READ_AUDIT_WINDOW_S:
            return False
        _READS_SEEN[key] = now_s
        _READS_SEEN.move_to_end(key)
        while len(_READS_SEEN) > _READS_MAX:
            _READS_SEEN.popitem(last=False)
        return True


def record_tenant_read(engine: Engine, *, now: datetime, principal: Principal, action: str,
                       path_params: Mapping[str, Any], route: str) -> None:
    """Audit a read of the tenant's data made with an operator-minted token (an operator may
    hold its secret), committed before the route runs. ``route``: the method and path template
    (``GET /v1/files/{file_id}/content``); the resource is the job, file, sweep or model it names.

    Once per token, action and resource per READ_AUDIT_WINDOW_S in each gateway process: the log
    shows which operator-held token read what and when, without turning every poll of a job into
    a serialized write of the audit chain."""
    resource = _read_resource(principal, path_params)
    if not _first_read_in_window((str(engine.url), principal.token_id, action, resource), time.monotonic()):
        return
    audit.append_now(engine, at=now, actor=actor(principal), action=action, outcome=audit.ALLOWED,
                     tenant=principal.tenant_name, resource=resource,
                     reason=f"{route[:200]} with operator-minted token #{principal.token_id}: an operator may "
                            f"hold its secret (first such read in {int(READ_AUDIT_WINDOW_S // 60)} min)")


# ------------------------------------------------------------- metadata views
def _tenant_row(session: Session, name: str) -> Tenant:
    row = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if row is None:
        raise NotFound(f"no tenant {name!r}", param="tenant")
    return row


def job_metadata(job: FineTuningJob) -> dict[str, Any]:
    """What operators may see of a job: ids, states, timings, Slurm facts, errors, counts."""
    def ts(dt: datetime | None) -> int | None:
        return int(dt.timestamp()) if dt else None

    return {"id": job.id, "status": job.status, "phase": job.phase, "model": job.model,
            "training_file": job.training_file, "validation_file": job.validation_file,
            "created_at": ts(job.created_at), "started_at": ts(job.started_at), "finished_at": ts(job.finished_at),
            "slurm_job_id": job.slurm_job_id, "slurm_state": job.slurm_state, "attempt": job.attempt,
            "qos": job.qos, "time_limit_min": job.time_limit_min, "estimated_tokens": job.estimated_tokens,
            "trained_tokens": job.trained_tokens, "cleanup": job.cleanup, "error": job.error,
            "result_files": job.result_files or []}


def file_metadata(row: DataFile) -> dict[str, Any]:
    """Ids, sizes, status, timing; never the name, the lines or the validation messages
    (they quote dataset text)."""
    counts = (row.validation or {}).get("error_counts") or {}
    return {"id": row.id, "bytes": row.bytes, "sha256": row.sha256, "status": row.status,
            "purpose": row.purpose, "job_id": row.job_id, "created_at": int(row.created_at.timestamp()),
            "error_counts": counts}


def tenant_metadata(*, session: Session, engine: Engine, principal: Principal, tenant: str, kind: str,
                    now: datetime, limit: int = 500) -> list[dict[str, Any]]:
    """Metadata of a tenant's jobs or files for an operator; the look is audited."""
    _operator(principal)
    row = _tenant_row(session, tenant)
    if kind == "jobs":
        jobs = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == row.id)
                            .order_by(col(FineTuningJob.created_at).desc()).limit(limit))
        out = [job_metadata(j) for j in jobs]
    else:
        files = session.exec(select(DataFile).where(DataFile.tenant_id == row.id, col(DataFile.deleted_at).is_(None))
                             .order_by(col(DataFile.created_at).desc()).limit(limit))
        out = [file_metadata(f) for f in files]
    audit.append_now(engine, at=now, actor=actor(principal), action=f"metadata.{kind}", outcome=audit.ALLOWED,
                     tenant=tenant, reason=f"{len(out)} rows")
    return out


# --------------------------------------------------------------------- audit
def tenant_audit(*, session: Session, principal: Principal, after: int | None, limit: int) -> list[AuditEntry]:
    """The audit entries about the caller's tenant, newest first, before seq ``after``; only those
    after the newest ``tenant.delete`` tombstone of its name (a deleted namesake's entries stay in
    the chain, never shown to the tenant made after it)."""
    if principal.tenant_name is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    deleted = session.exec(select(sa.func.max(AuditEntry.seq)).where(
        AuditEntry.tenant == principal.tenant_name, AuditEntry.action == audit.TENANT_DELETED)).one() or 0
    q = select(AuditEntry).where(AuditEntry.tenant == principal.tenant_name, col(AuditEntry.seq) > deleted)
    if after is not None:
        q = q.where(col(AuditEntry.seq) < after)
    return list(session.exec(q.order_by(col(AuditEntry.seq).desc()).limit(limit)))


def audit_object(e: AuditEntry) -> dict[str, Any]:
    """The API shape of an audit entry (``audit.entry``), its hash included."""
    return {"object": "audit.entry", "seq": e.seq, "at": e.at.isoformat(), "actor_token_id": e.actor_token_id,
            "actor_role": e.actor_role, "actor": e.actor, "tenant": e.tenant, "resource": e.resource,
            "action": e.action,
            "grant_id": e.grant_id, "outcome": e.outcome, "reason": e.reason, "hash": e.hash}
