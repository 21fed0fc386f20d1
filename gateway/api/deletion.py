"""/v1/tenant/deletion_request: a tenant admin asks for the tenant and all its data to be deleted.

The sysadmin carries it out (``finetune admin tenant delete``) and the request then reads ``done``
with the deletion receipt's sha256; until then it can be withdrawn.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gateway.access.policy import Policy
from gateway.api.deps import NowDep, PrincipalDep, SessionDep, access
from gateway.services import deletionrequests as svc

router = APIRouter(prefix="/v1/tenant/deletion_request", tags=["tenant"])


class Ask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Annotated[str, Field(max_length=svc.MAX_REASON)] = ""


@router.post("", dependencies=[access(Policy.TENANT_ADMIN)])
def ask(body: Ask, session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Ask for the tenant's deletion (a pending request already there is returned as it is)."""
    return svc.request_object(svc.request_deletion(session=session, principal=principal, reason=body.reason,
                                                   now=now))


@router.get("", dependencies=[access(Policy.TENANT_ADMIN)])
def status(session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """The tenant's newest deletion request and where it stands; ``{"status": "none"}`` when none was made."""
    row = svc.latest_request(session=session, principal=principal)
    return svc.request_object(row) if row else {"object": "tenant.deletion_request", "status": "none"}


@router.delete("", dependencies=[access(Policy.TENANT_ADMIN)])
def withdraw(session: SessionDep, principal: PrincipalDep, now: NowDep) -> dict[str, Any]:
    """Withdraw the tenant's pending deletion request."""
    return svc.request_object(svc.withdraw_request(session=session, principal=principal, now=now))
