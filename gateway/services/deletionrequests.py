"""A tenant admin's request that the tenant be deleted, and the sysadmin's list of them.

The request only asks: the sysadmin carries it out (``finetune admin tenant delete NAME``, as root:
``gateway.services.tenantdelete``), which marks it ``done`` with the deletion receipt's sha256. The row
names the tenant as text and outlives it; a tenant made later under the same name sees only the
requests made since it was created.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from gateway.access import audit
from gateway.access.tokens import Principal, actor, actor_label
from gateway.errors import Forbidden, NotFound, ServiceError
from gateway.models import Role, Tenant, TenantDeletionRequest

PENDING, DONE, WITHDRAWN = "pending", "done", "withdrawn"
MAX_REASON = 500


def _own_tenant(session: Session, principal: Principal) -> Tenant:
    if principal.role is not Role.TENANT_ADMIN or principal.tenant_id is None:
        raise Forbidden("only your tenant's admin (role tenant_admin) asks for the tenant's deletion")
    tenant = session.get(Tenant, principal.tenant_id)
    if tenant is None:
        raise Forbidden("this token's tenant no longer exists")
    return tenant


def _requests(session: Session, tenant: Tenant) -> list[TenantDeletionRequest]:
    """The tenant's requests since it was created (a deleted namesake's stay its own), newest first."""
    return list(session.exec(select(TenantDeletionRequest).where(
        TenantDeletionRequest.tenant == tenant.name, col(TenantDeletionRequest.requested_at) >= tenant.created_at)
        .order_by(col(TenantDeletionRequest.requested_at).desc())))


def request_deletion(*, session: Session, principal: Principal, reason: str, now: datetime) -> TenantDeletionRequest:
    """Ask for the caller's tenant to be deleted (audited); a pending request already there is returned
    as it is. Forbidden unless the caller is the tenant's admin; ServiceError for a reason over 500
    characters."""
    tenant = _own_tenant(session, principal)
    if len(reason) > MAX_REASON:
        raise ServiceError(f"reason: at most {MAX_REASON} characters", param="reason")
    pending = next((r for r in _requests(session, tenant) if r.status == PENDING), None)
    if pending is not None:
        return pending
    row = TenantDeletionRequest(tenant=tenant.name, requested_by=actor_label(principal)[:100], reason=reason,
                                requested_at=now)
    session.add(row)
    session.flush()
    audit.append(session, at=now, actor=actor(principal), action="tenant.delete_request", outcome=audit.ALLOWED,
                 tenant=tenant.name, resource=row.id,
                 reason=f"{actor_label(principal)} asked for the tenant and all its data to be deleted "
                        "(the sysadmin carries it out: `finetune admin tenant delete`)")
    return row


def latest_request(*, session: Session, principal: Principal) -> TenantDeletionRequest | None:
    """The caller's tenant's newest deletion request (None: none asked). Forbidden unless its admin."""
    requests = _requests(session, _own_tenant(session, principal))
    return requests[0] if requests else None


def withdraw_request(*, session: Session, principal: Principal, now: datetime) -> TenantDeletionRequest:
    """Withdraw the caller's tenant's pending deletion request (audited). NotFound when none is
    pending; Forbidden unless the caller is the tenant's admin."""
    tenant = _own_tenant(session, principal)
    row = next((r for r in _requests(session, tenant) if r.status == PENDING), None)
    if row is None:
        raise NotFound("no pending deletion request for this tenant")
    row.status, row.decided_at, row.decided_by = WITHDRAWN, now, actor_label(principal)[:100]
    session.add(row)
    audit.append(session, at=now, actor=actor(principal), action="tenant.delete_withdrawn",
                 outcome=audit.ALLOWED, tenant=tenant.name, resource=row.id,
                 reason=f"{actor_label(principal)} withdrew the deletion request")
    return row


def pending_requests(*, session: Session) -> list[TenantDeletionRequest]:
    """Every pending deletion request, oldest first (what the sysadmin has to act on)."""
    return list(session.exec(select(TenantDeletionRequest).where(TenantDeletionRequest.status == PENDING)
                             .order_by(col(TenantDeletionRequest.requested_at))))


def request_object(row: TenantDeletionRequest) -> dict[str, Any]:
    """The API shape of a deletion request (``tenant.deletion_request``)."""
    def ts(dt: datetime | None) -> int | None:
        return int(dt.timestamp()) if dt else None

    return {"object": "tenant.deletion_request", "id": row.id, "tenant": row.tenant, "status": row.status,
            "reason": row.reason, "requested_by": row.requested_by, "requested_at": ts(row.requested_at),
            "decided_at": ts(row.decided_at), "decided_by": row.decided_by, "receipt_sha256": row.receipt_sha256}
