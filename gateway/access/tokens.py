"""API tokens: random, shown once, stored as sha256 hashes.

Every token minted or revoked, by any path (the admin CLI, the API, a rotation), is an
audit-log entry naming the role, the token's id and name (never the secret) and who did
it; for a tenant's token the tenant reads it (``finetune audit list``, ``finetune tokens
list``).

Provenance: each token records who minted it (``minted_by``: the minting token, or "local
admin CLI (uid N)") and ``minted_by_operator``: whether an operator (staff, sysadmin, root
at the CLI) may hold its secret. A tenant_admin token an operator minted decides no staff
access request (``decide_refusal``): otherwise a sysadmin could mint one and approve its
own request. Tokens a tenant token mints inherit its flag, and so does a rotation: an
operator can rotate a token it minted as well as anyone, so rotating proves nothing.

Claiming (``claim_token``) needs what no operator role holds: when an operator mints a
tenant_admin token for a tenant with no admin token of its own (``operator_mint``), the
gateway makes a one-time claim code, keeps only its sha256 on the token's row and writes
the code into the tenant's own storage, as the tenant's unix user, 0600
(``CLAIM-CODE-<token id>`` at the tenant root, the storage verb ``write_claim``); the
operator is told where it went, never the code. The token's holder presents the code
once, within ``CLAIM_TTL``: a new secret only it sees, ``minted_by_operator`` false, the
old token revoked. A wrong, expired or used code is refused and audited. Root, and
anything running as the tenant's unix user, can read the file: root is out of scope, the
tenant's own processes are the tenant.

Every token an operator mints for a tenant is an ``alert`` entry in the tenant's audit
log, and every read of tenant data made with an operator-minted token is audited
(``policy.tenant_read``, recorded by ``gateway.access.staff.record_tenant_read``).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gateway.access import audit, members
from gateway.access.policy import OPERATOR_ROLES
from gateway.errors import Conflict, Forbidden, NotFound, ServiceError
from gateway.models import TENANT_ROLES, ApiToken, Person, Role, Tenant, utcnow
from gateway.storage import layout

if TYPE_CHECKING:
    from gateway.storage import Storage

TOKEN_PREFIX = "sft_"
CLAIM_PREFIX = "sftclaim_"
CLAIM_TTL = timedelta(days=7)
CLAIM_CODE = re.compile(r"sftclaim_[A-Za-z0-9_-]{40,60}")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant member/admin (tenant set), or a sysadmin/staff (no tenant)."""

    token_id: int
    role: Role
    tenant_id: int | None
    tenant_name: str | None
    unix_user: str | None
    operator_minted: bool = False     # an operator may hold this token's secret: its reads are audited
    person: str | None = None         # a personal token's person (unix username); None: a service token
    via: str | None = None            # how that person signed in: munge | oidc
    token_name: str = ""


def actor_label(p: Principal) -> str:
    """Who acted, for the audit log: ``alice via munge``, ``service token 'ci' of tenant acme``."""
    if p.person:
        return f"{p.person} via {p.via or 'sign-in'}"
    name = f"{p.token_name!r}" if p.token_name else f"#{p.token_id}"
    return f"{p.role.value} token {name}" + (f" of tenant {p.tenant_name}" if p.tenant_name else "")


def who(p: Principal) -> str:
    """What a job or file records as its maker: the person, else ``token:<name or #id>``."""
    return p.person or f"token:{p.token_name or '#' + str(p.token_id)}"


def actor(p: Principal) -> audit.Actor:
    """The audit log's actor for ``p``: its token, its role and who it is."""
    return audit.Actor(p.token_id, p.role.value, actor_label(p))


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


def create_token(*, session: Session, role: Role, tenant: Tenant | None, name: str = "",
                 minted_by: Minter | None = None, now: datetime | None = None,
                 operator: bool | None = None, note: str = "",
                 claim: tuple[str, datetime] | None = None, person: Person | None = None,
                 via: str | None = None, expires_at: datetime | None = None) -> tuple[str, ApiToken]:
    """Create a token; return (the secret, shown only now; its row). Audited in the same
    transaction, under the tenant's name for tenant tokens: an ``alert`` entry when an
    operator mints it (not for a rotation or claim, which pass ``operator``).

    ``minted_by`` defaults to the local admin CLI (anything with the database at hand is
    the operator side); ``operator`` overrides the minter's provenance (a rotation keeps
    the old token's, a claim clears it); ``claim``: its claim code's hash and expiry;
    ``person``, ``via``, ``expires_at``: a personal token (``gateway.access.signin``).
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
                   minted_by_token_id=minter.token_id, minted_by_operator=by_operator,
                   claim_code_hash=claim[0] if claim else None, claim_expires_at=claim[1] if claim else None,
                   person_id=person.id if person else None, via=via, expires_at=expires_at)
    session.add(row)
    session.flush()
    if claim and row.id is not None and operator is None:
        note += (f"; its one-time claim code, valid until {claim[1].isoformat(timespec='seconds')}, is in your "
                 f"storage ({layout.claim_code_file(row.id)}, readable by your unix user only): `finetune tokens "
                 "claim` with it makes the token your own")
    flag = "; operator-minted: it decides no staff access request" if by_operator and role is Role.TENANT_ADMIN \
        else ""
    alert = tenant is not None and by_operator and operator is None
    if alert:
        flag += ("; an operator may hold its secret: every read of your data made with it is audited. "
                 "Not asked for? Revoke it (`finetune tokens revoke`)")
    audit.append(session, at=now, actor=audit.Actor(minter.token_id, minter.role, minter.label), action="token.create",
                 outcome=audit.ALERT if alert else audit.ALLOWED, tenant=tenant.name if tenant else None,
                 resource=f"token:{row.id}", reason=f"{_describe(row)} minted by {minter.label}{flag}{note}")
    return secret, row


def authenticate(*, session: Session, token: str) -> Principal | None:
    """The principal of a bearer token, or None when unknown or revoked."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    return principal_of(session, row) if row is not None else None


def principal_of(session: Session, row: ApiToken) -> Principal | None:
    """The principal token ``row`` stands for now; None when it is revoked, has expired, or is a
    personal token whose person no longer belongs to its tenant (``members.role_in``)."""
    if row.revoked_at is not None or row.id is None:
        return None
    if row.expires_at is not None and row.expires_at <= utcnow():
        return None
    tenant = session.get(Tenant, row.tenant_id) if row.tenant_id is not None else None
    role, person = Role(row.role), session.get(Person, row.person_id) if row.person_id is not None else None
    if row.person_id is not None:           # a personal token holds what its person holds now
        current = members.role_in(session, tenant, person.username) if person and tenant else None
        if current is None:
            return None
        role = current
    return Principal(row.id, role, row.tenant_id, tenant.name if tenant else None,
                     tenant.unix_user if tenant else None, row.minted_by_operator,
                     person.username if person else None, row.via, row.name)


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
        # else: an operator's admin token locks the tenant's own admins out
        why = (f"token #{principal.token_id} descends from an operator's mint: it cannot revoke your tenant's "
               f"own token #{token_id}; one of your own admins can")
        bind = session.get_bind()
        audit.append_now(bind.engine, at=now, actor=actor(principal),
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
    """Replace the caller's token with a new secret (same role, tenant, name and provenance)
    and revoke the old one, in one transaction: a copy of the old secret stops working.

    An operator-minted token stays operator-minted: whoever minted it can rotate it too.
    Only ``claim_token``, with the code delivered to the tenant's storage, makes it the
    tenant's own. Raises Conflict when the caller's token is already revoked.
    """
    _tenant_of(principal)
    old = _live_row(session, principal)
    note = ("; still operator-minted: rotation claims nothing (`finetune tokens claim` with the code in "
            "your storage does)") if old.minted_by_operator and old.role == Role.TENANT_ADMIN.value else ""
    return _replace(session=session, principal=principal, old=old, now=now, operator=old.minted_by_operator,
                    how="rotation", note=note)


def _live_row(session: Session, principal: Principal) -> ApiToken:
    old = session.get(ApiToken, principal.token_id)
    if old is None or old.revoked_at is not None or old.id is None:
        raise Conflict(f"token #{principal.token_id} is already revoked")
    return old


def _replace(*, session: Session, principal: Principal, old: ApiToken, now: datetime, operator: bool,
             how: str, note: str) -> tuple[str, ApiToken]:
    """A new token like ``old`` (provenance ``operator``), and ``old`` revoked: (secret, row)."""
    tenant = session.get(Tenant, old.tenant_id)
    assert tenant is not None and old.id is not None
    minter = Minter(f"{how} of token #{old.id} by its holder", principal.role.value, old.id, operator)
    claim = None
    if how == "rotation" and old.claim_code_hash and old.claim_expires_at and old.claimed_at is None:
        # the claim code moves to the new secret: a tenant that rotated first can still claim
        claim, old.claim_code_hash, old.claim_expires_at = (old.claim_code_hash, old.claim_expires_at), None, None
        session.add(old)
        session.flush()
        note += f"; its claim code (in {layout.claim_code_file(old.id)}) now claims the new token"
    secret, row = create_token(session=session, role=Role(old.role), tenant=tenant, name=old.name,
                               minted_by=minter, now=now, operator=operator, note=note, claim=claim)
    revoke_token(session=session, token_id=old.id, now=now, note=f" ({how}: replaced by token #{row.id})",
                 revoked_by=Minter(principal_label(principal), principal.role.value, old.id, operator))
    return secret, row


# ------------------------------------------------------------------ claim codes
@dataclass(frozen=True)
class Minted:
    """What ``operator_mint`` made: the secret (shown once), the row, and where the claim
    code went (``claim_file``: an absolute path in the tenant's storage) or why none was
    made (``own_admins``: the tenant's own admin tokens, which mint it one that decides)."""

    secret: str
    row: ApiToken
    claim_file: str | None = None
    own_admins: tuple[int, ...] = ()


def claim_text(*, tenant: str, token_id: int, code: str, minted_by: str, expires: datetime) -> str:
    """The claim code file's content: the code on a line of its own, and what to do with it."""
    return (f"slurm-finetune: the one-time claim code of tenant_admin token #{token_id} of tenant {tenant},\n"
            f"minted by {minted_by}. It is valid once, until {expires.isoformat(timespec='seconds')}.\n\n"
            f"{code}\n\n"
            "With that token logged in (`finetune login`), run:\n"
            f"    finetune tokens claim --code-file {layout.claim_code_file(token_id)}\n"
            "The token then becomes your tenant's own (a new secret only you see; the old one is revoked)\n"
            "and can decide staff access requests. The gateway wrote this file as your unix user, mode 0600;\n"
            "the operator who minted the token was not shown the code. Delete the file once claimed.\n")


def operator_mint(*, session: Session, storage: Storage, role: Role, tenant: Tenant | None, name: str = "",
                  minted_by: Minter | None = None, now: datetime) -> Minted:
    """An operator mints a token (``create_token``); a tenant_admin token for a tenant with
    no admin token of its own also gets a one-time claim code, its hash on the row and the
    code written into the tenant's storage through ``storage`` (as the tenant). Raises what
    ``create_token`` raises, and the storage's errors when the code cannot be delivered (the
    caller's transaction then rolls back: nothing is minted)."""
    others: tuple[int, ...] = ()
    if role is Role.TENANT_ADMIN and tenant is not None and tenant.id is not None:
        others = tuple(own_admins(session=session, tenant_id=tenant.id))
    if role is not Role.TENANT_ADMIN or tenant is None or others:
        secret, row = create_token(session=session, role=role, tenant=tenant, name=name, minted_by=minted_by,
                                   now=now)
        return Minted(secret, row, own_admins=others)
    code, expires = CLAIM_PREFIX + secrets.token_urlsafe(36), now + CLAIM_TTL
    secret, row = create_token(session=session, role=role, tenant=tenant, name=name, minted_by=minted_by, now=now,
                               claim=(hash_token(code), expires))
    assert row.id is not None
    text = claim_text(tenant=tenant.name, token_id=row.id, code=code, minted_by=row.minted_by, expires=expires)
    stored = str(storage.call(tenant.name, "write_claim", {"token_id": row.id, "text": text}).result["name"])
    return Minted(secret, row, claim_file=storage.tenant(tenant.name).absolute((stored,)))


def _claim_refusal(held: ApiToken | None, old: ApiToken, tid: int, now: datetime) -> ServiceError | None:
    """Why the code that matches ``held`` (None: matches no token) does not claim ``old``, or None."""
    if held is None or held.tenant_id != tid:
        return Forbidden("that is not a claim code of your tenant: give it exactly as the file "
                         "CLAIM-CODE-<token id> at your storage root holds it", param="code", code="claim_refused")
    if held.claimed_at is not None:
        return Conflict(f"this claim code was already used ({held.claimed_at.isoformat()}): it works once; "
                        f"token #{held.id} was replaced then (`finetune tokens list`)", param="code",
                        code="claim_used")
    if held.id != old.id:
        return Forbidden(f"this claim code is token #{held.id}'s, not the calling token #{old.id}'s: claim it "
                         "with that token", param="code", code="claim_refused")
    if held.claim_expires_at is None or now >= held.claim_expires_at:
        when = held.claim_expires_at.isoformat() if held.claim_expires_at else "?"
        return Forbidden(f"this claim code expired at {when}: ask your sysadmin for a new tenant_admin token "
                         "(it comes with a new code)", param="code", code="claim_expired")
    return None


def claim_token(*, session: Session, principal: Principal, code: str, now: datetime) -> tuple[str, ApiToken]:
    """Make the caller's operator-minted tenant_admin token the tenant's own with its one-time
    claim code: (the new secret, its row), ``minted_by_operator`` false, the old token revoked.

    Refused and audited (committed although the request fails): Forbidden for a code that
    is not this token's, or expired; Conflict for a code already used or a revoked caller.
    """
    tid = _tenant_of(principal)
    old = _live_row(session, principal)
    code = code.strip()
    held = session.exec(select(ApiToken).where(ApiToken.claim_code_hash == hash_token(code))).first() \
        if CLAIM_CODE.fullmatch(code) else None
    why = _claim_refusal(held, old, tid, now)
    if why is not None:
        audit.append_now(session.get_bind().engine, at=now,
                         actor=actor(principal), action="token.claim",
                         outcome=audit.DENIED, tenant=principal.tenant_name, resource=f"token:{principal.token_id}",
                         reason=f"refused: {why.message}")
        raise why
    # one claim per code even when two race: the row changes only while it is unclaimed and live
    t = ApiToken.__table__  # type: ignore[attr-defined]
    won = session.execute(sa.update(t).where(t.c.id == old.id, t.c.claimed_at.is_(None), t.c.revoked_at.is_(None))
                          .values(claimed_at=now))
    if won.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict("this claim code was just used: it works once (`finetune tokens list`)", param="code",
                       code="claim_used")
    session.refresh(old)
    name = principal.tenant_name
    return _replace(session=session, principal=principal, old=old, now=now, operator=False, how="claim",
                    note=f"; claimed with the one-time code delivered to {name}'s storage: {name}'s own admin "
                         "token now, it decides staff access requests")


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
            "staff access requests (an operator could be deciding its own request). Claim it with the one-time "
            "code your sysadmin's mint wrote into your storage (`finetune tokens claim --code-file "
            "CLAIM-CODE-<token id>`), or ask one of your tenant's own admins (`finetune tokens list`)")


def principal_object(*, session: Session, principal: Principal) -> dict[str, Any]:
    """What ``GET /v1/me`` answers: the calling token and who holds it."""
    row = session.get(ApiToken, principal.token_id)
    return {"object": "principal", "token_id": principal.token_id, "role": principal.role.value,
            "tenant": principal.tenant_name, "person": principal.person, "via": principal.via,
            "actor": actor_label(principal),
            "expires_at": int(row.expires_at.timestamp()) if row is not None and row.expires_at else None}


def token_object(row: ApiToken) -> dict[str, Any]:
    """The API shape of a token: never the secret or its hash. Use is not tracked."""
    def ts(dt: datetime | None) -> int | None:
        return int(dt.timestamp()) if dt else None

    return {"object": "token", "id": row.id, "name": row.name, "role": row.role, "prefix": row.prefix,
            "created_at": ts(row.created_at), "revoked_at": ts(row.revoked_at), "revoked_by": row.revoked_by,
            "minted_by": row.minted_by, "minted_by_token_id": row.minted_by_token_id,
            "minted_by_operator": row.minted_by_operator,
            "decides_access": row.role == Role.TENANT_ADMIN.value and not row.minted_by_operator
            and row.revoked_at is None,
            "claim_expires_at": ts(row.claim_expires_at) if row.claimed_at is None and row.revoked_at is None
            else None, "claimed_at": ts(row.claimed_at),
            "kind": "personal" if row.person_id is not None else "service", "via": row.via,
            "expires_at": ts(row.expires_at)}
