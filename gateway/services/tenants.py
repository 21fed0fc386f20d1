"""Tenants in the gateway database (the Slurm account and unix user: gateway.storage.onboarding).

The first-start helpers (``onboarding_token``, ``onboard_empty``) are here, above gateway.access,
because they make a tenant's row and a token for it in one transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from gateway.access import members
from gateway.access.audit import Actor, append, open_database
from gateway.access.tokens import create_token
from gateway.db import session_scope
from gateway.errors import NotFound, ServiceError
from gateway.models import Role, Tenant, TenantMember, utcnow
from gateway.slurm.validate import validate_tenant_name
from gateway.storage.layout import unix_user_for


def ensure_tenant(*, session: Session, name: str) -> Tenant:
    """Return tenant ``name``, creating its row if needed. Raises InvalidNameError."""
    validate_tenant_name(name)
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        tenant = Tenant(name=name, unix_user=unix_user_for(name))
        session.add(tenant)
        session.flush()
    return tenant


def get_tenant(*, session: Session, name: str) -> Tenant:
    """The tenant row called ``name``; NotFound (saying how to onboard it) when there is none."""
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise NotFound(f"no tenant {name!r}: onboard it with `finetune admin tenant add {name}`")
    return tenant


def _group(name: str | None, option: str) -> str | None:
    """``name`` when it is a unix group NSS knows ("" clears); ServiceError otherwise."""
    if name is None or name == "":
        return None
    if members.group_gid(name) is None:
        raise ServiceError(f"no unix group {name!r} on this host (as NSS reports groups: /etc/group, sssd, "
                           "LDAP): create it, or check the name", param=option)
    return name


def set_people(*, session: Session, name: str, by: str, group: str | None = None, admin_group: str | None = None,
               add: tuple[str, ...] = (), admins: tuple[str, ...] = (), remove: tuple[str, ...] = ()) -> Tenant:
    """Bind tenant ``name`` to its unix groups (members, admins; "" unbinds one) and add or remove
    explicit members; audited in the tenant's log. ServiceError for a group NSS does not know."""
    tenant = get_tenant(session=session, name=name)
    changes = []
    if group is not None:
        tenant.unix_group = _group(group, "group")
        changes.append(f"member group {tenant.unix_group or '(none)'}")
    if admin_group is not None:
        tenant.admin_group = _group(admin_group, "admin_group")
        changes.append(f"admin group {tenant.admin_group or '(none)'}")
    for username, admin in [(u, False) for u in add] + [(u, True) for u in admins]:
        row = members.explicit_member(session, tenant, username) or \
            TenantMember(tenant_id=tenant.id or 0, username=username)
        row.admin = admin
        session.add(row)
        changes.append(f"{'admin' if admin else 'member'} {username}")
    for username in remove:
        if (gone := members.explicit_member(session, tenant, username)) is not None:
            session.delete(gone)
            changes.append(f"removed {username}")
    session.add(tenant)
    if changes:
        append(session, at=utcnow(), actor=Actor(None, Role.SYSADMIN.value, by), action="tenant.people",
               outcome="allowed", tenant=name, reason="; ".join(changes))
    members.GROUPS.forget()
    return tenant


def people(*, session: Session, tenant: Tenant) -> dict[str, Any]:
    """Who tenant ``tenant`` is: its groups and explicit members (the API/CLI shape)."""
    rows = session.exec(select(TenantMember).where(TenantMember.tenant_id == tenant.id)).all()
    return {"group": tenant.unix_group, "admin_group": tenant.admin_group,
            "members": sorted(r.username for r in rows if not r.admin),
            "admins": sorted(r.username for r in rows if r.admin)}


def onboarding_token(engine: Engine, tenant: str, *, name: str = "") -> str:
    """A member token for ``tenant`` (its row made if missing), committed; for the demo and
    local mode, which onboard a tenant and hand its token to the person at the keyboard."""
    with session_scope(engine) as s:
        secret, _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=tenant),
                                 name=name)
    return secret


def onboard_empty(settings: Any, tenant: str, *, name: str) -> str | None:
    """On an empty database (local mode's first start): tenant ``tenant`` with a member token
    called ``name`` (its storage is made on first use); returns the token, or None when the
    database has tenants already (e.g. the demo's)."""
    engine = open_database(settings)
    try:
        with session_scope(engine) as s:
            if s.exec(select(Tenant)).first() is not None:
                return None
        return onboarding_token(engine, tenant, name=name)
    finally:
        engine.dispose()
