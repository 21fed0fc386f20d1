"""Staff access routes.

- /v1/staff/...: operators (staff, sysadmin): tenant metadata, their access requests, and
  the only routes that serve tenant content to them, each checking the grant at every
  request and auditing the decision before a byte leaves.
- /v1/access-requests, /v1/audit: tenants list requests for their resources, their
  admin approves, denies or revokes, and everyone in the tenant reads its audit trail.
- /v1/tokens: the tenant's tokens and who minted each (every mint and revocation is in its
  audit trail); its admin mints and revokes them, and any token rotates itself. An
  operator-minted admin token becomes the tenant's own only with the one-time claim code
  delivered to the tenant's storage (``/v1/tokens/claim``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.access import staff as svc
from gateway.access import tokens as tokens_svc
from gateway.access.policy import Policy
from gateway.api.deps import NowDep, PrincipalDep, SessionDep, SettingsDep, access
from gateway.api.jobs import event_object
from gateway.models import DataFile, Role
from gateway.services import files as files_svc

router = APIRouter(tags=["staff"])
STAFF, GRANT = [access(Policy.STAFF)], [access(Policy.STAFF_GRANT)]
TENANT, TENANT_ADMIN = [access(Policy.TENANT)], [access(Policy.TENANT_ADMIN)]


class NewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: Annotated[str, Field(min_length=1, max_length=24)]
    resource: Annotated[str, Field(min_length=3, max_length=60)]
    reason: Annotated[str, Field(min_length=1, max_length=1000)]
    duration: Annotated[str, Field(max_length=12)] | Annotated[int, Field(ge=1)] = "2h"


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: Annotated[str, Field(min_length=1, max_length=200)]


class NewToken(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["member", "tenant_admin"] = "member"
    name: Annotated[str, Field(max_length=100)] = ""


# ------------------------------------------------------------------ operators
@router.get("/v1/staff/tenants/{tenant}/{kind}", dependencies=STAFF)
def tenant_metadata(tenant: str, kind: Literal["jobs", "files"], request: Request, session: SessionDep,
                    principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Metadata only: ids, states, sizes, timings, Slurm ids, errors (audited)."""
    data = svc.tenant_metadata(session=session, engine=request.app.state.engine, principal=principal,
                               tenant=tenant, kind=kind, now=now)
    return {"object": "list", "data": data}


@router.post("/v1/staff/access-requests", dependencies=STAFF, status_code=201)
def create_request(body: NewRequest, session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Ask for access to one resource of a tenant (``job:ID`` or ``file:ID``) for ``duration``
    (``90m``, ``2h``, ``1d``; 1 minute to 7 days); pending until the tenant's admin decides. Audited."""
    req = svc.request_access(session=session, principal=principal, tenant=body.tenant, resource=body.resource,
                             reason=body.reason, duration=body.duration, now=now)
    return svc.request_object(req, body.tenant, now, session)


@router.get("/v1/staff/access-requests", dependencies=STAFF)
def own_requests(session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """List the access requests this token made, newest first, each with its state now."""
    rows = svc.list_own_requests(session=session, principal=principal)
    names = svc.tenant_names(session=session, ids={r.tenant_id for r in rows})
    return {"object": "list", "data": [svc.request_object(r, names.get(r.tenant_id), now, session) for r in rows]}


def _stream(chunks: Iterator[bytes], size: int) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"content-length": str(size), "cache-control": "no-store"})


@router.get("/v1/staff/files/{file_id}/content", dependencies=GRANT)
def file_content(file_id: str, request: Request, session: SessionDep,
                 settings: SettingsDep, principal: PrincipalDep, now: NowDep) -> StreamingResponse:
    """A dataset or result file, under an active grant for file:ID."""
    tenant, row = svc.check_grant(session=session, engine=request.app.state.engine, principal=principal,
                                  kind="file", rid=file_id, action="read.file_content", now=now)
    assert isinstance(row, DataFile)
    return _stream(files_svc.stream_file(settings, tenant, row), row.bytes)


@router.get("/v1/staff/jobs/{job_id}/results/{file_id}", dependencies=GRANT)
def job_result(job_id: str, file_id: str, request: Request, session: SessionDep, settings: SettingsDep,
               principal: PrincipalDep, now: NowDep) -> StreamingResponse:
    """A result file (adapter, eval, metrics) of a job, under an active grant for job:ID."""
    tenant, job = svc.check_grant(session=session, engine=request.app.state.engine, principal=principal,
                                  kind="job", rid=job_id, action="read.job_result", now=now)
    row = svc.job_result_file(session=session, job=job, file_id=file_id)  # type: ignore[arg-type]
    return _stream(files_svc.stream_file(settings, tenant, row), row.bytes)


@router.get("/v1/staff/jobs/{job_id}/events", dependencies=GRANT)
def job_events(job_id: str, request: Request, session: SessionDep, principal: PrincipalDep, now: NowDep,
               limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
    """A job's event log, newest first, under an active grant for job:ID."""
    _, job = svc.check_grant(session=session, engine=request.app.state.engine, principal=principal,
                             kind="job", rid=job_id, action="read.job_events", now=now)
    rows = svc.job_events(session=session, job=job, limit=limit)  # type: ignore[arg-type]
    return {"object": "list", "data": [event_object(e) for e in rows], "has_more": len(rows) == limit}


# -------------------------------------------------------------------- tenants
@router.get("/v1/access-requests", dependencies=TENANT)
def tenant_requests(session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """List the access requests for this tenant's resources, newest first (any member may read them)."""
    rows = svc.list_tenant_requests(session=session, principal=principal)
    return {"object": "list", "data": [svc.request_object(r, principal.tenant_name, now, session) for r in rows]}


@router.post("/v1/access-requests/{request_id}/{action}", dependencies=TENANT_ADMIN)
def decide(request_id: str, action: Literal["approve", "deny", "revoke"], session: SessionDep,
           principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Approve or deny a pending access request, or revoke an active grant (tenant admins; audited).

    409 when the request is not in a state that allows ``action``."""
    req = svc.decide_request(session=session, principal=principal, request_id=request_id, action=action, now=now)
    return svc.request_object(req, principal.tenant_name, now, session)


@router.get("/v1/audit", dependencies=TENANT)
def tenant_audit(session: SessionDep, principal: PrincipalDep, after: int | None = Query(None, ge=1, le=2**31 - 1),
                 limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
    """Audit entries about this tenant's resources (requests, decisions, reads), newest first."""
    rows = svc.tenant_audit(session=session, principal=principal, after=after, limit=limit)
    return {"object": "list", "data": [svc.audit_object(e) for e in rows], "has_more": len(rows) == limit}


@router.get("/v1/tokens", dependencies=TENANT)
def tenant_tokens(session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """Every token of this tenant (revoked ones too): role, name, when, who minted and revoked it."""
    rows = tokens_svc.list_tokens(session=session, principal=principal)
    return {"object": "list", "data": [tokens_svc.token_object(r) for r in rows]}


def _with_secret(secret: str, row: Any) -> dict[str, Any]:
    return {**tokens_svc.token_object(row), "token": secret}


@router.post("/v1/tokens", dependencies=TENANT_ADMIN, status_code=201)
def mint_token(body: NewToken, session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """A new member or tenant_admin token for this tenant; the secret is in this answer only."""
    secret, row = tokens_svc.mint_tenant_token(session=session, principal=principal, role=Role(body.role),
                                               name=body.name, now=now)
    return _with_secret(secret, row)


@router.post("/v1/tokens/rotate", dependencies=TENANT, status_code=201)
def rotate_token(session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Replace the calling token with a new secret and revoke it; its provenance stays (an operator-minted
    token stays operator-minted: claim it with ``/v1/tokens/claim``)."""
    secret, row = tokens_svc.rotate_token(session=session, principal=principal, now=now)
    return _with_secret(secret, row)


@router.post("/v1/tokens/claim", dependencies=TENANT, status_code=201)
def claim_token(body: Claim, session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Make the calling operator-minted tenant_admin token the tenant's own with the one-time code the
    operator's mint wrote into the tenant's storage: a new secret (in this answer only), the old one
    revoked. 403 for a wrong or expired code, 409 for a used one (each audited)."""
    secret, row = tokens_svc.claim_token(session=session, principal=principal, code=body.code, now=now)
    return _with_secret(secret, row)


@router.post("/v1/tokens/{token_id}/revoke", dependencies=TENANT_ADMIN)
def revoke_token(token_id: Annotated[int, Path(ge=1, le=2**31 - 1)], session: SessionDep,
                 principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Revoke one of this tenant's tokens (tenant admins); 404 for an id outside the tenant."""
    row = tokens_svc.revoke_tenant_token(session=session, principal=principal, token_id=token_id, now=now)
    return tokens_svc.token_object(row)
