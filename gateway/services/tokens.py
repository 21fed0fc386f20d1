"""API tokens: random, shown once, stored as sha256 hashes."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlmodel import Session, select

from gateway.models import TENANT_ROLES, ApiToken, Role, Tenant, utcnow
from gateway.services import ServiceError

TOKEN_PREFIX = "sft_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant member/admin (tenant set), or a sysadmin/staff (no tenant)."""

    token_id: int
    role: Role
    tenant_id: int | None
    tenant_name: str | None
    unix_user: str | None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(*, session: Session, role: Role, tenant: Tenant | None, name: str = "") -> tuple[str, ApiToken]:
    """Create a token; return (the secret, shown only now; its row)."""
    if role in TENANT_ROLES and tenant is None:
        raise ServiceError(f"role {role.value} needs --tenant", param="tenant")
    if role not in TENANT_ROLES and tenant is not None:
        raise ServiceError(f"role {role.value} is not bound to a tenant: drop --tenant", param="tenant")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(tenant_id=tenant.id if tenant else None, role=role.value, name=name,
                   prefix=secret[:10], token_hash=hash_token(secret))
    session.add(row)
    session.flush()
    return secret, row


def authenticate(*, session: Session, token: str) -> Principal | None:
    """The principal of a bearer token, or None when unknown or revoked."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    if row is None or row.revoked_at is not None or row.id is None:
        return None
    tenant = session.get(Tenant, row.tenant_id) if row.tenant_id is not None else None
    return Principal(row.id, Role(row.role), row.tenant_id, tenant.name if tenant else None,
                     tenant.unix_user if tenant else None)


def revoke_token(*, session: Session, token_id: int) -> None:
    row = session.get(ApiToken, token_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
