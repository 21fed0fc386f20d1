"""/v1/webhooks: a tenant's receivers of job events (signed the Standard Webhooks way) and their delivery log."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from gateway.access.policy import Policy
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.models import WebhookDelivery, WebhookEndpoint
from gateway.services import webhooks as svc

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


class Register(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: Annotated[str, Field(min_length=8, max_length=2000)]


def endpoint_object(row: WebhookEndpoint, secret: bool = False) -> dict[str, Any]:
    """An endpoint as the API shows it; its ``secret`` only when just registered."""
    out = {"object": "webhook_endpoint", "id": row.id, "url": row.url, "created_at": int(row.created_at.timestamp()),
           "events": sorted(svc.EVENTS.values())}
    return {**out, "secret": row.secret} if secret else out


def delivery_object(d: WebhookDelivery) -> dict[str, Any]:
    """One delivery of the log: the event, its job, where it stands."""
    return {"object": "webhook_delivery", "id": d.id, "type": d.event_type, "job_id": d.job_id, "status": d.status,
            "attempts": d.attempts, "last_status": d.last_status, "last_error": d.last_error,
            "created_at": int(d.created_at.timestamp()),
            "delivered_at": int(d.delivered_at.timestamp()) if d.delivered_at else None}


@router.post("", dependencies=[access(Policy.TENANT_ADMIN)])
def register(body: Register, session: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> dict[str, Any]:
    """Register an http(s) endpoint for the tenant's job events; the answer holds its signing secret, once."""
    return endpoint_object(svc.register(session=session, settings=settings, principal=principal, url=body.url),
                           secret=True)


@router.get("", dependencies=[access(Policy.TENANT)])
def list_endpoints(session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """The tenant's endpoints (without their secrets)."""
    return {"object": "list", "data": [endpoint_object(r) for r in svc.endpoints(session=session, principal=principal)]}


@router.delete("/{webhook_id}", dependencies=[access(Policy.TENANT_ADMIN)])
def delete_endpoint(webhook_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """Delete an endpoint; nothing more is sent to it."""
    svc.remove(session=session, principal=principal, endpoint_id=webhook_id)
    return {"object": "webhook_endpoint", "id": webhook_id, "deleted": True}


@router.get("/{webhook_id}/deliveries", dependencies=[access(Policy.TENANT)])
def list_deliveries(webhook_id: str, session: SessionDep, principal: PrincipalDep,
                    limit: int = Query(50, ge=1, le=200)) -> dict[str, Any]:
    """The endpoint's delivery log, newest first."""
    rows = svc.deliveries(session=session, principal=principal, endpoint_id=webhook_id, limit=limit)
    return {"object": "list", "data": [delivery_object(d) for d in rows]}
