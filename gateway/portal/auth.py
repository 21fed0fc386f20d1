"""Sign-in with an API token, sign-out (ends the session server-side), and the landing redirects."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import RedirectResponse

from gateway.access.policy import Policy
from gateway.access.tokens import Minter, actor_label, authenticate, revoke_token
from gateway.api.deps import SessionDep, now_for
from gateway.models import ApiToken
from gateway.portal.session import (
    COOKIE,
    LOGIN_COOKIE,
    LOGIN_S,
    SESSION_S,
    NeedLogin,
    check_csrf,
    close_session,
    cookie_args,
    current_user,
    new_login_cookie,
    open_session,
    portal_key,
    secure_cookies,
    session_payload,
    unsign,
)
from gateway.portal.web import PortalRoute, UserDep, portal_access, render

router = APIRouter(route_class=PortalRoute, include_in_schema=False)


def safe_next(target: str | None, default: str) -> str:
    """Only a portal path of this site: never an absolute or scheme-relative URL."""
    if target and target.startswith("/portal/") and not target.startswith("//") and "\\" not in target:
        return target
    return default


@router.get("/", dependencies=[portal_access(Policy.PUBLIC)])
def root() -> Response:
    """Redirect the site root to the portal."""
    return RedirectResponse("/portal/", status_code=307)


@router.get("/portal", dependencies=[portal_access(Policy.PUBLIC)])
@router.get("/portal/", dependencies=[portal_access(Policy.PUBLIC)])
def home(request: Request, session: SessionDep) -> Response:
    """Redirect to the admin pages (sysadmin), the jobs page (anyone else signed in) or the sign-in page."""
    try:
        user = current_user(request, session)
    except NeedLogin:
        return RedirectResponse("/portal/login", status_code=303)
    return RedirectResponse("/portal/admin" if user.is_admin else "/portal/jobs", status_code=303)


def login_page(request: Request, *, next_: str, error: str | None = None, status: int = 200,
               choices: list[str] | None = None) -> Response:
    """The sign-in page (token form; the single sign-on button when configured), with ``error`` and,
    for a person in several tenants, links that sign on to each of ``choices``."""
    value, csrf = new_login_cookie(portal_key(request))
    resp = render(request, "login.html", status=status, login_csrf=csrf, next=next_, error=error,
                  sso=request.app.state.settings.oidc_name if request.app.state.settings.oidc_issuer else None,
                  choices=choices or [])
    resp.set_cookie(LOGIN_COOKIE, value, **cookie_args(request, LOGIN_S))
    return resp


@router.get("/portal/login", dependencies=[portal_access(Policy.PUBLIC)])
def login_form(request: Request, next: str | None = None) -> Response:
    """The sign-in page; it sets the login cookie that carries the form's CSRF token."""
    return login_page(request, next_=safe_next(next, ""))


@router.post("/portal/login", dependencies=[portal_access(Policy.PUBLIC)])
def login(request: Request, session: SessionDep, token: Annotated[str, Form(max_length=200)] = "",
          csrf: Annotated[str, Form(max_length=100)] = "",
          next: Annotated[str, Form(max_length=500)] = "") -> Response:
    """Sign in with an API token: open a portal session and redirect to ``next`` (a portal path only);
    401 with the form again for an invalid or revoked token."""
    key = portal_key(request)
    pre = unsign(key, request.cookies.get(LOGIN_COOKIE))
    check_csrf(str(pre["csrf"]) if pre else "", csrf)
    principal = authenticate(session=session, token=token.strip())
    row = session.get(ApiToken, principal.token_id) if principal else None
    if principal is None or row is None:
        return login_page(request, next_=safe_next(next, ""), status=401,
                           error="That token is not valid (mistyped, revoked, or from another gateway). "
                                 "Ask your tenant administrator for a new one.")
    default = "/portal/admin" if principal.role.value == "sysadmin" else "/portal/jobs"
    resp = RedirectResponse(safe_next(next, default), status_code=303)
    resp.set_cookie(COOKIE, open_session(session, key, row), **cookie_args(request, SESSION_S))
    resp.delete_cookie(LOGIN_COOKIE, path="/portal", secure=secure_cookies(request), httponly=True,
                       samesite="strict")
    return resp


@router.post("/portal/logout", dependencies=[portal_access(Policy.AUTHENTICATED)])
def logout(request: Request, session: SessionDep, user: UserDep,
           csrf: Annotated[str, Form(max_length=100)] = "") -> Response:
    """End the session on the server (its cookie is refused from now on, by every worker), then drop it."""
    check_csrf(user.csrf, csrf)
    payload = session_payload(request)
    if payload is not None:
        close_session(session, payload)
    if user.principal.via == "oidc":    # the personal token the sign-on minted for this session goes too
        revoke_token(session=session, token_id=user.principal.token_id, now=now_for(request, session),
                     revoked_by=Minter(actor_label(user.principal), user.principal.role.value,
                                       user.principal.token_id, operator=False), note="; signed out of the portal")
    resp = RedirectResponse("/portal/login?signed_out=1", status_code=303)
    resp.delete_cookie(COOKIE, path="/portal", secure=secure_cookies(request), httponly=True,
                       samesite="strict")
    return resp
