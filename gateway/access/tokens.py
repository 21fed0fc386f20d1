"""API tokens: random, shown once, stored as sha256 hashes.

Every token minted or revoked, by any path (the admin CLI, the API, a rotation), is an
audit-log entry naming the role, the token's id and name (never the secret) and who did
it; for a tenant's token the tenant reads it (``finetune audit list``, ``finetune tokens
list``).

Provenance: each token records who minted it (``minted_by``: the minting token, or "local
admin CLI (uid N)") and ``minted_by_operator``: whether an operator (staff, sysadmin, root
at the CLI) may hold its secret. A tenant_admin token an operator minted decides no staff
access request (``decide_refusal``): otherwise a sysadmin could mint one and approve its
own request. Tokens a tenant token mints inherit its flag. The first admin token, which
the CLI mints at onboarding, becomes the tenant's own by rotation (``rotate_token``: a new
secret only its caller sees, the old one revoked at once) -- but only while the tenant has
no admin token of its own yet, so an operator cannot claim a second one behind an onboarded
tenant's back; after that, the tenant's own admins mint further admin tokens.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from gateway.access import audit
from gateway.access.policy import OPERATOR_ROLES
from gateway.errors import Conflict, Forbidden, NotFound, ServiceError
from gateway.models import TENANT_ROLES, ApiToken, Role, Tenant, utcnow

TOKEN_PREFIX = "sft_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant member/admin (tenant set), or a sysadmin/staff (no tenant)."""

    token_id: int
    role: Role
    tenant_id: int | None
    tenant_name: str | None
    unix_user: str | None


@dataclass(frozen=True)
class Minter:
    """Who mints or revokes a token, as the audit log and the token's row name it."""

    label: str                    # "token #5 (tenant_admin of acme)", "local admin CLI (uid 0)"
    role: str                     # the audit entry's actor role
    token_id: int | None = None   # the acting token, if any
    operator: bool = True         # may an operator hold what this one mints?


def local_admin() -> Minter:
    """The admin CLI on the gateway host (root: an operator by definition)."""
    return Minter(f"local admin CLI (uid {os.getuid()})", Role.SYSADMIN.value)


def principal_label(p: Principal) -> str:
    """``token #<id> (<role> of <tenant>)`` (no tenant: ``(<role>)``): the caller as a Minter label."""
    return f"token #{p.token_id} ({p.role.value}" + (f" of {p.tenant_name})" if p.tenant_name else ")")


def minter_of(*, session: Session, principal: Principal) -> Minter:
    """The caller as a minter: an operator's mint when the caller is one or descends from one."""
    row = session.get(ApiToken, principal.token_id)
    if row is None or row.revoked_at is not None:      # revoked moments ago (the principal cache)
        raise Forbidden(f"token #{principal.token_id} is revoked")
    operator = principal.role in OPERATOR_ROLES or row.minted_by_operator
    return Minter(principal_label(principal), principal.role.value, principal.token_id, operator)


def hash_token(token: str) -> str:
    """The sha256 (hex) of a token secret: what the token row stores and a lookup matches."""
    return hashlib.sha256(token.encode()).hexdigest()


def _describe(row: ApiToken) -> str:
    return f"{row.role} token #{row.id}" + (f" {row.name!r}" if row.name else "")


def _tenant_name(session: Session, row: ApiToken) -> str | None:
    tenant = session.get(Tenant, row.tenant_id) if row.tenant_id is not None else None
    return tenant.name if tenant else None


def onboarding_token(engine: Any, tenant: str, *, name: str = "") -> str:
    """A member token for ``tenant`` (its row made if missing), committed; for the demo and
    local mode, which onboard a tenant and hand its token to the person at the keyboard."""
    from gateway.db import session_scope
    from gateway.services.tenants import ensure_tenant

    with session_scope(engine) as s:
        secret, _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=tenant),
                                 name=name)
    return secret


def create_token(*, session: Session, role: Role, tenant: Tenant | None, name: str = "",
                 minted_by: Minter | None = None, now: datetime | None = None,
                 operator: bool | None = None, note: str = "") -> tuple[str, ApiToken]:
    """Create a token; return (the secret, shown only now; its row). Audited in the same
    transaction, under the tenant's name for tenant tokens.

    ``minted_by`` defaults to the local admin CLI (anything with the database at hand is
    the operator side); ``operator`` overrides the minter's provenance (a claim).
    """
    if role in TENANT_ROLES and tenant is None:
        raise ServiceError(f"role {role.value} needs --tenant", param="tenant")
    if role not in TENANT_ROLES and tenant is not None:
        raise ServiceError(f"role {role.value} is not bound to a tenant: drop --tenant", param="tenant")
    if len(name) > 100:
        raise ServiceError("name: at most 100 characters", param="name")
    minter = minted_by or local_admin()
    by_operator = role in OPERATOR_ROLES or (minter.operator if operator is None else operator)
    secret, now = TOKEN_PREFIX + secrets.token_urlsafe(32), now or utcnow()
    row = ApiToken(tenant_id=tenant.id if tenant else None, role=role.value, name=name, created_at=now,
                   prefix=secret[:10], token_hash=hash_token(secret), minted_by=minter.label[:100],
                   minted_by_token_id=minter.token_id, minted_by_operator=by_operator)
    session.add(row)
    session.flush()
    flag = "; operator-minted: it decides no staff access request" if by_operator and role is Role.TENANT_ADMIN \
        else ""
    audit.append(session, at=now, actor=audit.Actor(minter.token_id, minter.role), action="token.create",
                 outcome=audit.ALLOWED, tenant=tenant.name if tenant else None, resource=f"token:{row.id}",
                 reason=f"{_describe(row)} minted by {minter.label}{flag}{note}")
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


def revoke_token(*, session: Session, token_id: int, revoked_by: Minter | None = None,
                 now: datetime | None = None, note: str = "") -> ApiToken:
    """Revoke token ``token_id`` (audited); an already revoked one is returned unchanged.

    Raises NotFound for an unknown id.
    """
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"no token #{token_id}", param="token_id")
    if row.revoked_at is not None:
        return row
    by = revoked_by or local_admin()
    row.revoked_at, row.revoked_by = now or utcnow(), by.label[:100]
    session.add(row)
    session.flush()
    audit.append(session, at=row.revoked_at, actor=audit.Actor(by.token_id, by.role), action="token.revoke",
                 outcome=audit.ALLOWED, tenant=_tenant_name(session, row), resource=f"token:{row.id}",
                 reason=f"{_describe(row)} revoked by {by.label}{note}")
    return row


# ------------------------------------------------------------ tenant self-service
def _tenant_of(principal: Principal) -> int:
    if principal.tenant_id is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    return principal.tenant_id


def _admin_of(principal: Principal) -> int:
    if principal.role is not Role.TENANT_ADMIN or principal.tenant_id is None:
        raise Forbidden("only your tenant's admin (role tenant_admin) mints and revokes its tokens")
    return principal.tenant_id


def list_tokens(*, session: Session, principal: Principal) -> list[ApiToken]:
    """Every token of the caller's tenant (revoked ones too), oldest first."""
    tid = _tenant_of(principal)
    return list(session.exec(select(ApiToken).where(ApiToken.tenant_id == tid).order_by(col(ApiToken.id))))


def mint_tenant_token(*, session: Session, principal: Principal, role: Role, name: str,
                      now: datetime) -> tuple[str, ApiToken]:
    """A tenant admin mints a member or tenant_admin token for its own tenant; it inherits
    the caller's provenance (a token descending from an operator's mint stays operator-minted)."""
    tid = _admin_of(principal)
    if role not in TENANT_ROLES:
        raise ServiceError(f"role {role.value}: tenant admins mint member or tenant_admin tokens", param="role")
    tenant = session.get(Tenant, tid)
    assert tenant is not None
    return create_token(session=session, role=role, tenant=tenant, name=name,
                        minted_by=minter_of(session=session, principal=principal), now=now)


def revoke_tenant_token(*, session: Session, principal: Principal, token_id: int, now: datetime) -> ApiToken:
    """A tenant admin revokes one of its tenant's tokens; another tenant's id answers 404.
    An operator-minted admin token revokes no token of the tenant's own (refused, audited)."""
    tid = _admin_of(principal)
    row = session.get(ApiToken, token_id)
    if row is None or row.tenant_id != tid:
        raise NotFound(f"no token #{token_id} in your tenant", param="token_id")
    minter = minter_of(session=session, principal=principal)
    if minter.operator and not row.minted_by_operator:
        # else: revoke the tenant's own admins, then claim a token by rotation (no own admin left)
        why = (f"token #{principal.token_id} descends from an operator's mint: it cannot revoke your tenant's "
               f"own token #{token_id}; one of your own admins can")
        bind = session.get_bind()
        audit.append_now(bind.engine, at=now, actor=audit.Actor(principal.token_id, principal.role.value),
                         action="token.revoke", outcome=audit.DENIED, tenant=principal.tenant_name,
                         resource=f"token:{token_id}", reason=f"refused: {why}")
        raise Forbidden(why)
    return revoke_token(session=session, token_id=token_id, now=now, revoked_by=minter)


def own_admins(*, session: Session, tenant_id: int, besides: int | None = None) -> list[int]:
    """Ids of the tenant's live tenant_admin tokens that no operator minted."""
    q = select(ApiToken.id).where(ApiToken.tenant_id == tenant_id, ApiToken.role == Role.TENANT_ADMIN.value,
                                  col(ApiToken.revoked_at).is_(None), col(ApiToken.minted_by_operator).is_(False))
    return [i for i in session.exec(q) if i is not None and i != besides]


def rotate_token(*, session: Session, principal: Principal, now: datetime) -> tuple[str, ApiToken]:
    """Replace the caller's token with a new secret (same role, tenant, name) and revoke the
    old one, in one transaction: a copy of the old secret (e.g. the operator who minted it)
    stops working.

    An operator-minted tenant_admin token rotated while its tenant has no admin token of its
    own is *claimed*: the new one decides staff access requests. Otherwise the new token keeps
    the old one's provenance.
    """
    tid = _tenant_of(principal)
    old = session.get(ApiToken, principal.token_id)
    if old is None or old.revoked_at is not None:
        raise Conflict(f"token #{principal.token_id} is already revoked")
    tenant = session.get(Tenant, tid)
    assert tenant is not None and old.id is not None
    operator, note = old.minted_by_operator, ""
    if operator and old.role == Role.TENANT_ADMIN.value:
        others = own_admins(session=session, tenant_id=tid, besides=old.id)
        if others:
            note = (f"; still operator-minted: {tenant.name} already has admin tokens of its own "
                    f"({', '.join(f'#{i}' for i in others)}), one of which can mint you a token that decides")
        else:
            operator, note = False, f"; claimed: {tenant.name}'s own admin token now, #{old.id} revoked"
    minter = Minter(f"rotation of token #{old.id} by its holder", principal.role.value, old.id, operator)
    secret, row = create_token(session=session, role=Role(old.role), tenant=tenant, name=old.name,
                               minted_by=minter, now=now, operator=operator, note=note)
    revoke_token(session=session, token_id=old.id, now=now, note=f" (rotated into token #{row.id})",
                 revoked_by=Minter(principal_label(principal), principal.role.value, old.id, operator))
    return secret, row


def decide_refusal(*, session: Session, principal: Principal) -> str | None:
    """Why the caller's tenant_admin token may not decide staff access requests, or None.

    Operator-minted admin tokens decide no request of any operator (every request is an
    operator's): the operator who minted it, or who could have, could approve its own.
    """
    row = session.get(ApiToken, principal.token_id)
    if row is None or row.revoked_at is not None:      # revoked moments ago (the principal cache)
        return f"token #{principal.token_id} is revoked"
    if not row.minted_by_operator:
        return None
    by = row.minted_by or "an unrecorded minter"
    return (f"token #{principal.token_id} was minted by {by}, an operator, so it cannot approve, deny or revoke "
            "staff access requests (an operator could be deciding its own request). Claim a token of your own "
            "with `finetune tokens rotate` (while your tenant has no admin token of its own), or ask one of "
            "your tenant's own admins (`finetune tokens list`)")


def token_object(row: ApiToken) -> dict[str, Any]:
    """The API shape of a token: never the secret or its hash. Use is not tracked."""
    def ts(dt: datetime | None) -> int | None:
        return int(dt.timestamp()) if dt else None

    return {"object": "token", "id": row.id, "name": row.name, "role": row.role, "prefix": row.prefix,
            "created_at": ts(row.created_at), "revoked_at": ts(row.revoked_at), "revoked_by": row.revoked_by,
            "minted_by": row.minted_by, "minted_by_token_id": row.minted_by_token_id,
            "minted_by_operator": row.minted_by_operator,
            "decides_access": row.role == Role.TENANT_ADMIN.value and not row.minted_by_operator
            and row.revoked_at is None}
