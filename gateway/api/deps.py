"""Request dependencies: settings, a DB session per request, the calling principal."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlmodel import Session

from gateway.access.policy import OPERATOR_ROLES, Policy, admits, declares, refusal, tenant_read
from gateway.access.staff import db_now, record_refusal, record_tenant_read
from gateway.access.tokens import Principal, authenticate
from gateway.config import Settings
from gateway.db import session_scope
from gateway.errors import Forbidden, Unauthorized

# Dependencies are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in its
# thread pool, one hop each; these do at most a sub-millisecond query, so they run inline
# and the endpoint itself is the request's only thread-pool hop.


async def get_settings(request: Request) -> Settings:
    """The app's Settings (``app.state.settings``)."""
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One session per request: committed when the route succeeds, rolled back otherwise."""
    with session_scope(request.app.state.engine) as session:
        yield session


# ``scope="function"``: the commit runs when the route returns, before the response goes out.
# FastAPI's default ("request") exits yield dependencies after the response is sent, so a client
# could read a 200 (or follow a 303) before its write was committed, or get a 200 for a write whose
# commit then failed.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


class PrincipalCache:
    """Authenticated tokens for ``ttl_s`` seconds (keyed by the token's sha256), so a busy
    client costs no token query per request. A revocation takes effect within ``ttl_s``."""

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 10_000):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._data: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Principal | None:
        """The principal cached under ``key``; None when there is none or it is older than ``ttl_s``."""
        hit = self._data.get(key)
        if hit is None or time.monotonic() - hit[0] > self.ttl_s:
            return None
        return hit[1]

    def put(self, key: str, principal: Principal) -> None:
        """Cache ``principal`` under ``key`` (the token's sha256); a full cache is emptied first."""
        with self._lock:
            if len(self._data) >= self.max_entries:
                self._data.clear()
            self._data[key] = (time.monotonic(), principal)


async def get_principal(request: Request, session: SessionDep) -> Principal:
    """The caller, from ``Authorization: Bearer <token>`` (cached ``ttl_s``); Unauthorized when the
    header is missing or the token is unknown or revoked."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token: send `Authorization: Bearer <token>`")
    cache: PrincipalCache | None = getattr(request.app.state, "principals", None)
    key = hashlib.sha256(token.encode()).hexdigest()
    principal = cache.get(key) if cache is not None else None
    if principal is None:
        principal = authenticate(session=session, token=token)
        if principal is None:
            raise Unauthorized("invalid or revoked API token")
        if cache is not None:
            cache.put(key, principal)
    return principal


SettingsDep = Annotated[Settings, Depends(get_settings)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]


def now_for(request: Request, session: Session) -> datetime:
    """The app's clock: ``app.state.clock(session)`` when set (tests move it), else DB time."""
    clock: Callable[[Any], datetime] = getattr(request.app.state, "clock", None) or db_now
    return clock(session)


async def get_now(request: Request, session: SessionDep) -> datetime:
    """The request's clock (``now_for``): DB time unless a test set ``app.state.clock``."""
    return now_for(request, session)


NowDep = Annotated[datetime, Depends(get_now)]


def access(policy: Policy | str) -> Any:
    """``Depends`` that declares and enforces a route's access policy (gateway.access).

    Operators (staff, sysadmin) refused by a tenant route are audited: an attempt to
    reach tenant content outside the grant-checked staff routes leaves a trace. So is every
    read of tenant data (``policy.tenant_read``) made with an operator-minted tenant token.
    """
    policy = Policy(policy)
    if policy is Policy.PUBLIC:
        async def public() -> None:
            return None

        return Depends(declares(public, policy))

    async def check(request: Request, principal: PrincipalDep, session: SessionDep) -> Principal:
        if not admits(policy, principal.role):
            if principal.role in OPERATOR_ROLES:
                record_refusal(request.app.state.engine, now=now_for(request, session), principal=principal,
                               path_params=request.path_params, route=f"{request.method} {request.url.path}")
            raise Forbidden(refusal(policy, principal.role))
        if principal.operator_minted and principal.tenant_id is not None:
            route = getattr(request.scope.get("route"), "path", request.url.path)
            if (action := tenant_read(policy, request.method, route)) is not None:
                record_tenant_read(request.app.state.engine, now=now_for(request, session), principal=principal,
                                   action=action, path_params=request.path_params, route=f"{request.method} {route}")
        return principal

    return Depends(declares(check, policy))
