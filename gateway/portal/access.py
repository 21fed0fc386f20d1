"""Staff access page for tenants: requests for their resources, the admin's approve/deny/revoke
forms (CSRF-checked; not shown to a tenant_admin token an operator minted, which the service
refuses anyway), and the tenant's audit trail."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import RedirectResponse

from gateway.access import staff as svc
from gateway.access import tokens as tokens_svc
from gateway.access.policy import Policy
from gateway.api.deps import SessionDep, now_for
from gateway.models import Role
from gateway.portal.session import check_csrf
from gateway.portal.web import PortalRoute, UserDep, portal_access, render

router = APIRouter(prefix="/portal/access", route_class=PortalRoute, include_in_schema=False)


@router.get("", dependencies=[portal_access(Policy.TENANT)])
def access_page(request: Request, session: SessionDep, user: UserDep, done: str | None = None) -> Response:
    """The tenant's access requests and its latest 50 audit entries; decision buttons only for an admin
    whose decisions are not refused (e.g. not an operator-minted admin token)."""
    now = now_for(request, session)
    reqs = svc.list_tenant_requests(session=session, principal=user.principal)
    entries = svc.tenant_audit(session=session, principal=user.principal, after=None, limit=50)
    return render(request, "access.html", user=user, done=done, now=now,
                  requests=[svc.request_object(r, user.principal.tenant_name, now, session) for r in reqs],
                  entries=entries, can_decide=user.principal.role is Role.TENANT_ADMIN
                  and tokens_svc.decide_refusal(session=session, principal=user.principal) is None)


@router.post("/{request_id}/{action}", dependencies=[portal_access(Policy.TENANT_ADMIN)])
def decide(request_id: str, action: Literal["approve", "deny", "revoke"], request: Request, session: SessionDep,
           user: UserDep, csrf: Annotated[str, Form(max_length=100)] = "") -> Response:
    """Approve, deny or revoke an access request (tenant admins, CSRF-checked); back to the access page."""
    check_csrf(user.csrf, csrf)
    svc.decide_request(session=session, principal=user.principal, request_id=request_id, action=action,
                       now=now_for(request, session))
    return RedirectResponse(f"/portal/access?done={action}", status_code=303)
