"""Tenants in the gateway database (the Slurm account and unix user: gateway.storage.onboarding).

The first-start helpers (``onboarding_token``, ``onboard_empty``) are here, above gateway.access,
because they make a tenant's row and a token for it in one transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from gateway.access.audit import open_database
from gateway.access.tokens import create_token
from gateway.db import session_scope
from gateway.errors import NotFound
from gateway.models import Role, Tenant
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
