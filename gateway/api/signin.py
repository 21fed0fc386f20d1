"""Signing in with the site's identity, and who the caller is.

- ``POST /v1/auth/munge``: a MUNGE credential made by ``finetune login`` on a cluster host (no
  token needed) -> a personal token for the person it names (``gateway.access.signin``).
- ``GET /v1/me``: the calling token: its role, tenant, person and expiry (``finetune login``
  checks a pasted token with it before saving anything).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.access import signin
from gateway.access import tokens as tokens_svc
from gateway.access.policy import Policy
from gateway.api.deps import NowDep, PrincipalDep, SessionDep, SettingsDep, access
from gateway.config import Settings

router = APIRouter(tags=["sign-in"])


class MungeSignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    credential: Annotated[str, Field(min_length=1, max_length=8192)]
    tenant: Annotated[str | None, Field(default=None, min_length=1, max_length=24)] = None


def gateway_urls(request: Request, settings: Settings) -> list[str]:
    """The URLs a sign-in credential may be bound to: the configured public ones, else this request's."""
    return list(settings.public_urls) or [str(request.base_url).rstrip("/")]


def signed_in_object(done: signin.SignedIn) -> dict[str, Any]:
    """The new personal token (its secret, shown only here) and whose it is."""
    return {**tokens_svc.token_object(done.token), "token": done.secret, "person": done.person,
            "tenant": done.tenant}


@router.post("/v1/auth/munge", dependencies=[access(Policy.PUBLIC)])
def munge_sign_in(body: MungeSignIn, request: Request, session: SessionDep, settings: SettingsDep,
                  now: NowDep) -> dict[str, Any]:
    """A personal token (its secret in this answer only) for the unix user a MUNGE credential names;
    401 for a credential refused (expired, replayed, another key, bound elsewhere), 403 for a user in
    no tenant's group or not in the one asked for, 409 when several tenants need a choice."""
    done = signin.munge_sign_in(session=session, credential=body.credential, urls=gateway_urls(request, settings),
                                tenant=body.tenant, now=now, ttl=timedelta(hours=settings.personal_token_hours),
                                service_user=settings.service_user)
    return signed_in_object(done)


@router.get("/v1/me", dependencies=[access(Policy.AUTHENTICATED)])
def me(principal: PrincipalDep, session: SessionDep) -> dict[str, Any]:
    """The calling token: role, tenant, the person behind it (a personal token) and its expiry."""
    return tokens_svc.principal_object(session=session, principal=principal)
