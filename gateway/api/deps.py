"""Request dependencies: settings, a DB session per request, the calling principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlmodel import Session

from gateway.config import Settings
from gateway.services import ServiceError
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
