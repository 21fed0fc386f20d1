"""Request dependencies: settings, a DB session per request, the calling principal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlmodel import Session

from gateway.access import OPERATOR_ROLES, Policy, admits, declares, refusal
from gateway.config import Settings
from gateway.services import Forbidden, ServiceError
from gateway.services.tokens import Principal, authenticate


class Unauthorized(ServiceError):
    status = 401
    code = "invalid_api_key"


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def get_principal(request: Request, session: Annotated[Session, Depends(get_session)]) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing bearer token: send `Authorization: Bearer <token>`")
    principal = authenticate(session=session, token=token.strip())
    if principal is None:
        raise Unauthorized("invalid or revoked API token")
    return principal


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]


def now_for(request: Request, session: Session) -> datetime:
    """The app's clock: ``app.state.clock(session)`` when set (tests move it), else DB time."""
    from gateway.services.staff import db_now

    clock: Callable[[Any], datetime] = getattr(request.app.state, "clock", None) or db_now
    return clock(session)


def get_now(request: Request, session: SessionDep) -> datetime:
    return now_for(request, session)


NowDep = Annotated[datetime, Depends(get_now)]


def access(policy: Policy | str) -> Any:
    """``Depends`` that declares and enforces a route's access policy (gateway.access).

    Operators (staff, sysadmin) refused by a tenant route are audited: an attempt to
    reach tenant content outside the grant-checked staff routes leaves a trace.
    """
    policy = Policy(policy)
    if policy is Policy.PUBLIC:
        def public() -> None:
            return None

        return Depends(declares(public, policy))

    def check(request: Request, principal: PrincipalDep, session: SessionDep) -> Principal:
        if not admits(policy, principal.role):
            if principal.role in OPERATOR_ROLES:
                from gateway.services.staff import record_refusal

                record_refusal(request.app.state.engine, now=now_for(request, session), principal=principal,
                               path_params=request.path_params, route=f"{request.method} {request.url.path}")
            raise Forbidden(refusal(policy, principal.role))
        return principal

    return Depends(declares(check, policy))
