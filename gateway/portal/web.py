"""Rendering, errors and the request dependencies shared by every portal page."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlmodel import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.access.policy import OPERATOR_ROLES, Policy, admits, declares, refusal, tenant_read
from gateway.access.staff import record_refusal, record_tenant_read
from gateway.api.deps import SessionDep, now_for
from gateway.api.limits import SCOPE_FLAG as BODY_TOO_LARGE
from gateway.errors import Forbidden, ServiceError
from gateway.portal.session import NeedLogin, PortalUser, current_user

log = logging.getLogger("gateway.portal")
HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
STATIC_URL = "/portal/static"
# Every asset comes from this gateway; no inline script or style is needed.
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "same-origin", "x-frame-options": "DENY",
                    "cache-control": "no-store"}

env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                  trim_blocks=True, lstrip_blocks=True)


def _iso(dt: datetime | None) -> str:
    return dt.isoformat(timespec="seconds") if dt else ""


def _size(n: int | None) -> str:
    if n is None:
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _num(n: float | int | None) -> str:
    return "–" if n is None else f"{n:,}"


env.filters.update(iso=_iso, size=_size, num=_num)
env.globals.update(static=STATIC_URL)


def render(request: Request, name: str, *, user: PortalUser | None = None, status: int = 200,
           **context: Any) -> HTMLResponse:
    """The template ``name`` as a page, with the signed-in user and its CSRF token."""
    html = env.get_template(name).render(request=request, user=user, csrf=user.csrf if user else "",
                                         path=request.url.path, **context)
    return HTMLResponse(html, status_code=status)


def wants_json(request: Request) -> bool:
    """Whether the request's Accept header asks for JSON (the pages' scripts) rather than HTML."""
    return "application/json" in request.headers.get("accept", "")


def error_page(request: Request, status: int, message: str) -> Response:
    """An error as JSON for a script, else as an HTML page (with the user's header when signed in)."""
    if wants_json(request):
        return JSONResponse({"error": {"message": message, "status": status}}, status_code=status)
    user = None
    try:
        with Session(request.app.state.engine) as s:
            user = current_user(request, s)
    except Exception:  # noqa: BLE001 - an error page never fails for want of a session
        user = None
    titles = {400: "That did not work", 403: "Not allowed", 404: "Not found", 409: "Not now",
              413: "Too large", 429: "Too many jobs"}
    return render(request, "error.html", user=user, status=status, code=status,
                  title=titles.get(status, "Error"), message=message)


class PortalRoute(APIRoute):
    """Pages answer in HTML: sign-in redirects, readable error pages, security headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The route's handler, wrapped: NeedLogin redirects to sign-in, errors become error pages (500s get
        a logged reference), and every response gets the security headers."""
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                response = await inner(request)
            except NeedLogin:
                target = quote(request.url.path if request.method == "GET" else "/portal/", safe="/")
                response = RedirectResponse(f"/portal/login?next={target}", status_code=303)
            except ServiceError as e:
                response = error_page(request, e.status, e.message)
            except StarletteHTTPException as e:   # e.g. a body FastAPI could not parse
                if request.scope.get(BODY_TOO_LARGE):
                    return Response(status_code=413)   # the body-limit middleware has answered already
                response = error_page(request, e.status_code, str(e.detail))
            except RequestValidationError as e:
                first = e.errors()[0] if e.errors() else {}
                where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
                response = error_page(request, 400, f"{where or 'request'}: {first.get('msg', 'invalid')}")
            except Exception:
                if request.scope.get(BODY_TOO_LARGE):   # reading the body was cut off: not our failure
                    return Response(status_code=413)
                ref = uuid.uuid4().hex[:12]
                log.exception("portal error %s", ref)
                response = error_page(request, 500, f"Something went wrong on our side (reference {ref}).")
            for k, v in SECURITY_HEADERS.items():
                response.headers.setdefault(k, v)
            return response

        return handler


def get_user(request: Request, session: SessionDep) -> PortalUser:
    """The signed-in user; NeedLogin (a redirect to the sign-in page) when there is none."""
    return current_user(request, session)


UserDep = Annotated[PortalUser, Depends(get_user)]


def portal_access(policy: Policy | str) -> Any:
    """``Depends`` that declares and enforces a page's access policy, like the API's ``access``.

    Operators refused by a tenant page are audited, as on the API, and so are reads of tenant
    data made with an operator-minted token.
    """
    policy = Policy(policy)
    if policy is Policy.PUBLIC:
        def public() -> None:
            return None

        return Depends(declares(public, policy))

    def check(request: Request, user: UserDep, session: SessionDep) -> PortalUser:
        role = user.principal.role
        if not admits(policy, role):
            if role in OPERATOR_ROLES:
                record_refusal(request.app.state.engine, now=now_for(request, session), principal=user.principal,
                               path_params=request.path_params, route=f"{request.method} {request.url.path}")
            raise Forbidden(refusal(policy, role).replace("this route", "this page"))
        p = user.principal
        if p.operator_minted and p.tenant_id is not None:
            route = getattr(request.scope.get("route"), "path", request.url.path)
            if (action := tenant_read(policy, request.method, route)) is not None:
                record_tenant_read(request.app.state.engine, now=now_for(request, session), principal=p,
                                   action=action, path_params=request.path_params, route=f"{request.method} {route}")
        return user

    return Depends(declares(check, policy))
