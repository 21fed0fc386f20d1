"""Tenants in the gateway database (the Slurm side is gateway.slurm.admin)."""

from __future__ import annotations

from sqlmodel import Session, select

from gateway.errors import NotFound
from gateway.models import Tenant
from gateway.slurm.admin import unix_user_for
from gateway.slurm.validate import validate_tenant_name


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
