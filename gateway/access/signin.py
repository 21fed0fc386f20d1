"""Signing in as a person, with the site's identity: a unix account proved by MUNGE on a cluster
host (``munge_sign_in``), or by the site's OpenID Connect provider mapped to one (the portal).

Either way the account's tenants are those whose groups it is in (``gateway.access.members``):
none is refused ("in no tenant's group"), several need a choice. What comes back is a personal
token: it names the person, expires (``personal_token_hours``, 12 h by default), and holds, at
each use, the role the person's groups give them then (``tokens.authenticate``). Every sign-in,
and every refusal with its reason, is in the audit log ("alice via munge").

A MUNGE credential is accepted once, for this gateway, briefly: munged refuses one expired,
replayed on its host, or made under another key; here the payload must say it is a sign-in
(``munge.AUDIENCE``) for one of this gateway's URLs, live at most ``munge.MAX_TTL_S``, and carry
a nonce not seen before by any gateway sharing the database (``SignInNonce``). The accounts the
platform itself runs as (root, the service user, every tenant's unix user) never sign in: a
tenant's job processes run as its unix user and could make such a credential.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pwd
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gateway.access import audit, members, munge
from gateway.access.tokens import Minter, create_token
from gateway.errors import Conflict, Forbidden, Unauthorized
from gateway.models import ApiToken, Person, Role, SignInNonce, Tenant, utcnow

log = logging.getLogger("gateway.access.signin")


@dataclass(frozen=True)
class SignedIn:
    """A sign-in's result: the personal token's secret (shown once) and whose it is."""

    secret: str
    token: ApiToken
    person: str
    tenant: str
    role: Role


def _refuse(session: Session, err: Exception, *, who: str, via: str, now: datetime,
            tenant: str | None = None) -> Exception:
    """Audit a refused sign-in, committed now with what the request wrote so far (the credential's
    nonce: a refused credential is used up too), before the error rolls the rest back."""
    audit.append(session, at=now, actor=audit.Actor(None, "anonymous", f"{who} via {via}"), action="sign_in",
                 outcome=audit.DENIED, tenant=tenant, reason=f"refused: {err}"[:500])
    session.commit()
    return err


def reserved_accounts(session: Session, service_user: str) -> set[str]:
    """The accounts the platform runs as, which never sign in: root, the service user, tenants' users."""
    return {"root", service_user, *session.exec(select(Tenant.unix_user)).all()}


def person_sign_in(*, session: Session, username: str, uid: int, via: str, tenant: str | None, now: datetime,
                   ttl: timedelta, service_user: str) -> SignedIn:
    """Mint ``username``'s personal token for ``tenant`` (or their only tenant): refused when the
    account is the platform's own, in no tenant's group, or in several and none was picked."""
    label = f"{username} via {via}"
    if username in reserved_accounts(session, service_user) or uid == 0:
        raise _refuse(session, Forbidden(f"{username} is an account the platform itself runs as (root, the service "
                                         "user or a tenant's unix user): it cannot sign in", code="reserved_account"),
                      who=username, via=via, now=now)
    found = members.tenants_of(session, username)
    if not found:
        raise _refuse(session, Forbidden(f"{username} is in no tenant's group: ask your sysadmin to add you "
                                         "(`finetune admin tenant people TENANT --group GROUP`)", code="no_tenant"),
                      who=username, via=via, now=now)
    if tenant is None and len(found) > 1:
        raise Conflict(f"{username} belongs to tenants {', '.join(sorted(found))}: pick one with --tenant",
                       param="tenant", code="pick_tenant")
    name = tenant if tenant is not None else next(iter(found))
    if name not in found:
        raise _refuse(session, Forbidden(f"{username} is not a member of tenant {name!r} (member of: "
                                         f"{', '.join(sorted(found))})", code="not_a_member"),
                      who=username, via=via, now=now, tenant=name if len(name) <= 24 else None)
    role, row = found[name], session.exec(select(Tenant).where(Tenant.name == name)).one()
    person = session.exec(select(Person).where(Person.username == username)).first()
    if person is None:
        person = Person(username=username, uid=uid, created_at=now)
    person.uid, person.last_sign_in_at, person.last_via = uid, now, via
    session.add(person)
    session.flush()
    secret, token = create_token(session=session, role=role, tenant=row, name=label, now=now,
                                 minted_by=Minter(label, role.value, None, operator=False), person=person,
                                 via=via, expires_at=now + ttl,
                                 note=f"; personal, until {(now + ttl).isoformat(timespec='minutes')}")
    return SignedIn(secret, token, username, name, role)


def _claim_nonce(session: Session, nonce: object, expires: datetime) -> bool:
    """Record the credential's nonce; False when a gateway saw it before (a replay)."""
    if not isinstance(nonce, str) or not 16 <= len(nonce) <= 100:
        return False
    session.execute(sa.delete(SignInNonce).where(col(SignInNonce.expires_at) < utcnow()))
    key = hashlib.sha256(nonce.encode()).hexdigest()
    try:
        with session.begin_nested():
            session.add(SignInNonce(nonce=key, expires_at=expires))
            session.flush()
    except sa.exc.IntegrityError:
        return False
    return True


def munge_sign_in(*, session: Session, credential: str, urls: Iterable[str], tenant: str | None, now: datetime,
                  ttl: timedelta, service_user: str,
                  decode: Callable[[str], munge.Credential] = munge.decode) -> SignedIn:
    """Sign in with a MUNGE credential made by ``finetune login`` (``munge.login_payload``)."""
    try:
        cred = decode(credential)
    except munge.MungeError as e:
        refused = Unauthorized(f"MUNGE credential refused: {e}", code="munge_refused")
        if e.code not in munge.SEALED:     # anyone can post bytes: logged, not an audit entry each
            log.warning("sign-in refused: %s", e)
            raise refused from None
        raise _refuse(session, refused, who="someone", via="munge", now=now) from None
    try:
        username = pwd.getpwuid(cred.uid).pw_name
    except KeyError:
        username = f"uid {cred.uid}"
    try:
        payload = json.loads(cred.payload)
    except ValueError:
        payload = None
    accepted = sorted({u.rstrip("/") for u in urls})
    why = None
    if not isinstance(payload, dict) or payload.get("aud") != munge.AUDIENCE:
        why = "this MUNGE credential is not a sign-in credential (make one with `finetune login`)"
    elif payload.get("url") not in accepted:
        why = (f"this MUNGE credential is bound to {str(payload.get('url'))[:200]!r}, not to this gateway "
               f"({', '.join(accepted)})")
    elif cred.ttl > munge.MAX_TTL_S:
        why = f"this MUNGE credential lives {cred.ttl} s: a sign-in credential may live at most {munge.MAX_TTL_S} s"
    elif not _claim_nonce(session, payload.get("nonce"), datetime.fromtimestamp(cred.encode_time + cred.ttl, UTC)):
        why = "this MUNGE credential was already used (replayed): make a new one with `finetune login`"
    elif username.startswith("uid "):
        why = f"uid {cred.uid} has no account on the gateway's host"
    if why is not None:
        raise _refuse(session, Unauthorized(why, code="munge_refused"), who=username, via="munge", now=now)
    picked = tenant if tenant is not None else payload.get("tenant")
    return person_sign_in(session=session, username=username, uid=cred.uid, via="munge",
                          tenant=picked if isinstance(picked, str) else None, now=now, ttl=ttl,
                          service_user=service_user)
