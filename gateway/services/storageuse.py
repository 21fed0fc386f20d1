"""A tenant's storage: the quota the sysadmin set, and what the tenant uses of it.

The filesystem enforces the quota (``gateway.storage.quota``: a btrfs qgroup on the tenant's
subvolume); the database only records the limit that was set, for the audit and for a site
whose filesystem reports none. What the tenant sees (``usage``) is the filesystem's own count,
read by the broker as the tenant, beside the gateway's count of its files by kind.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from gateway.access.audit import Actor, append
from gateway.access.tokens import Principal
from gateway.config import Settings
from gateway.errors import Forbidden
from gateway.models import DataFile, Role, Tenant, utcnow
from gateway.services.tenants import get_tenant
from gateway.storage import quota, storage_for


def record_quota(*, session: Session, name: str, by: str, space: int | None) -> Tenant:
    """Record the space limit just set on tenant ``name``'s storage (None: no limit); audited in the
    tenant's log. NotFound when the tenant has no row."""
    tenant = get_tenant(session=session, name=name)
    tenant.quota_bytes = space
    session.add(tenant)
    append(session, at=utcnow(), actor=Actor(None, Role.SYSADMIN.value, by), action="tenant.quota",
           outcome="allowed", tenant=name, reason=f"space {quota.human(space) if space else 'unlimited'}")
    return tenant


def file_counts(session: Session, tenant_id: int) -> dict[str, dict[str, int]]:
    """The tenant's live files by kind: ``datasets`` (uploads) and ``results`` (jobs' results and
    checkpoint adapters), each ``{"count", "bytes"}``."""
    def count(where: Any) -> dict[str, int]:
        n, size = session.exec(select(func.count(), func.coalesce(func.sum(DataFile.bytes), 0)).where(
            DataFile.tenant_id == tenant_id, col(DataFile.deleted_at).is_(None), where)).one()
        return {"count": int(n), "bytes": int(size)}

    uploads, results = count(col(DataFile.path).is_(None)), count(col(DataFile.path).is_not(None))
    return {"datasets": uploads, "results": results}


def usage(*, session: Session, settings: Settings, principal: Principal) -> dict[str, Any]:
    """The calling tenant's storage (``GET /v1/usage``): the filesystem's used and limit bytes and what
    enforces the limit (None where nothing does), its files by kind, the retention policy."""
    if principal.tenant_id is None or principal.tenant_name is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    tenant = session.get(Tenant, principal.tenant_id)
    fs = storage_for(settings).tenant(principal.tenant_name).usage()
    limit = fs.limit_bytes if fs.enforced_by else None
    used = fs.used_bytes
    return {"object": "storage.usage", "tenant": principal.tenant_name,
            "storage": {**fs.as_dict(), "limit_bytes": limit,
                        "percent": round(100.0 * used / limit, 1) if used is not None and limit else None},
            "files": file_counts(session, principal.tenant_id),
            "retention": (tenant.retention if tenant is not None else None) or {}}
