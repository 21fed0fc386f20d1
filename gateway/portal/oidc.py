"""Portal sign-in with the site's OpenID Connect provider: authorization code with PKCE (authlib).

``GET /portal/oidc/login`` sends the browser to the provider with a fresh ``state``, ``nonce``
and PKCE verifier, kept in a short-lived signed cookie (SameSite=Lax: it must come back on the
provider's redirect). ``GET /portal/oidc/callback`` checks the state, exchanges the code (with
the verifier and the client secret) at the token endpoint, verifies the ID token against the
provider's JWKS (issuer, audience, expiry, nonce), maps the username claim to a unix user
(``oidc_user_map``, like Open OnDemand's ``user_map_match``) and signs that person in
(``gateway.access.signin.person_sign_in``): the tenants are those whose groups the unix user is
in. The portal session then holds that personal token; signing out ends the session and revokes
the token.

The callback answers with a page that continues to the portal itself (not a redirect): the
portal's session cookie is SameSite=Strict, and a browser does not send it on a redirect chain
that began at the provider.
"""

from __future__ import annotations

import html
import pwd
import re
import secrets
import threading
import time
from datetime import timedelta
from typing import Any, cast

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from gateway.access import members, signin
from gateway.access.policy import Policy
from gateway.api.deps import SessionDep, now_for
from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import ApiToken
from gateway.portal.auth import login_page, safe_next
from gateway.portal.session import (
    COOKIE,
    SESSION_S,
    cookie_args,
    open_session,
    portal_key,
    secure_cookies,
    sign,
    unsign,
)
from gateway.portal.web import PortalRoute, portal_access

router = APIRouter(route_class=PortalRoute, include_in_schema=False)
STATE_COOKIE = "sft_oidc"
STATE_S = 600
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]


class SignInFailed(Exception):
    """What went wrong at the provider or with its answer: shown on the sign-in page."""


class Provider:
    """The provider's metadata and keys (discovery, JWKS), fetched once and again on an unknown key."""

    def __init__(self, settings: Settings) -> None:
        if not (settings.oidc_issuer and settings.oidc_client_id):
            raise SignInFailed("single sign-on is not configured here (SFT_OIDC_ISSUER, SFT_OIDC_CLIENT_ID)")
        self.issuer, self.client_id = settings.oidc_issuer.rstrip("/"), settings.oidc_client_id
        self.secret_file, self.scopes = settings.oidc_client_secret_file, settings.oidc_scopes
        self._meta: dict[str, Any] | None = None
        self._jwks: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _get(self, url: str) -> dict[str, Any]:
        try:
            r = httpx.get(url, timeout=10)
            r.raise_for_status()
            return dict(r.json())
        except (httpx.HTTPError, ValueError) as e:
            raise SignInFailed(f"the sign-on provider at {self.issuer} did not answer ({type(e).__name__}); "
                               "try again, or sign in with a token") from None

    def meta(self) -> dict[str, Any]:
        """The provider's discovery document (its endpoints), checked to be for this issuer."""
        with self._lock:
            if self._meta is None:
                meta = self._get(self.issuer + "/.well-known/openid-configuration")
                if str(meta.get("issuer", "")).rstrip("/") != self.issuer:
                    raise SignInFailed(f"the provider's discovery document names issuer {meta.get('issuer')!r}, "
                                       f"not {self.issuer!r}")
                self._meta = meta
            return self._meta

    def keys(self, refresh: bool = False) -> dict[str, Any]:
        """The provider's signing keys (JWKS)."""
        with self._lock:
            if self._jwks is None or refresh:
                self._jwks = None
        if self._jwks is None:
            jwks = self._get(str(self.meta()["jwks_uri"]))
            with self._lock:
                self._jwks = jwks
        return self._jwks

    def userinfo(self, access_token: str, sub: str) -> dict[str, Any]:
        """The claims of the userinfo endpoint (where a conforming provider puts the profile claims
        when it also issues an access token), refused unless they are about the ID token's ``sub``."""
        endpoint = self.meta().get("userinfo_endpoint")
        if not endpoint:
            return {}
        try:
            r = httpx.get(str(endpoint), headers={"Authorization": f"Bearer {access_token}"}, timeout=10)
            r.raise_for_status()
            info = dict(r.json())
        except (httpx.HTTPError, ValueError) as e:
            raise SignInFailed(f"the provider's userinfo endpoint did not answer ({type(e).__name__})") from None
        if info.get("sub") != sub:
            raise SignInFailed("the provider's userinfo is about another subject than its ID token")
        return info

    def secret(self) -> str:
        """The client secret, from its file (empty: a public client, PKCE only)."""
        if self.secret_file is None:
            return ""
        try:
            return self.secret_file.read_text().strip()
        except OSError as e:
            raise SignInFailed(f"the portal cannot read its client secret ({self.secret_file}: {e.strerror})") from None

    def client(self, redirect_uri: str) -> Any:
        """An authlib OAuth2 client for this provider: PKCE (S256), the secret by HTTP Basic when there is one."""
        from authlib.integrations.httpx_client import OAuth2Client  # lazy: authlib, only for a sign-on

        secret = self.secret()
        return OAuth2Client(self.client_id, secret or None, scope=self.scopes, redirect_uri=redirect_uri,
                            code_challenge_method="S256",
                            token_endpoint_auth_method="client_secret_basic" if secret else "none", timeout=10)

    def verify(self, id_token: str, nonce: str) -> dict[str, Any]:
        """The ID token's claims, once its signature, issuer, audience, expiry and nonce check out."""
        from joserfc import errors, jwt  # lazy: JOSE (authlib's), only for a sign-on
        from joserfc.jwk import KeySet

        for refresh in (False, True):      # a key the provider rotated in: fetch the set once more
            try:
                keys = KeySet.import_key_set(cast(Any, self.keys(refresh)))
                token = jwt.decode(id_token, keys, algorithms=ALGORITHMS)
                break
            except (errors.JoseError, ValueError) as e:
                if refresh:
                    raise SignInFailed(f"the provider's ID token did not verify ({type(e).__name__})") from None
        claims = jwt.JWTClaimsRegistry(iss={"essential": True, "value": self.issuer},
                                       aud={"essential": True, "value": self.client_id},
                                       exp={"essential": True}, nonce={"essential": True, "value": nonce})
        try:
            claims.validate(token.claims)
        except errors.JoseError as e:
            raise SignInFailed(f"the provider's ID token was refused: {e.description or type(e).__name__}") from None
        return dict(token.claims)


def provider(request: Request) -> Provider:
    """The app's provider client (one per app: its metadata and keys are cached)."""
    state = request.app.state
    if getattr(state, "oidc", None) is None:
        state.oidc = Provider(state.settings)
    return state.oidc  # type: ignore[no-any-return]


def unix_user(settings: Settings, claims: dict[str, Any]) -> tuple[str, int]:
    """(unix username, uid) for the provider's claims: the username claim through ``oidc_user_map``,
    then NSS; SignInFailed when the claim is missing, does not match, or names no account here."""
    value = claims.get(settings.oidc_username_claim)
    if not isinstance(value, str) or not value:
        raise SignInFailed(f"the provider sent no {settings.oidc_username_claim!r} claim")
    match = re.fullmatch(settings.oidc_user_map, value)
    if match is None:
        raise SignInFailed(f"{value[:100]!r} does not map to a unix user here (SFT_OIDC_USER_MAP)")
    name = match.group(1) if match.groups() else match.group(0)
    try:
        return name, pwd.getpwnam(name).pw_uid
    except KeyError:
        raise SignInFailed(f"{value[:100]!r} maps to {name!r}, which has no account on this cluster") from None


def _failed(request: Request, message: str, status: int = 401, choices: list[str] | None = None) -> Response:
    resp = login_page(request, next_="", error=f"Single sign-on: {message}", status=status, choices=choices)
    resp.delete_cookie(STATE_COOKIE, path="/portal/oidc", secure=secure_cookies(request), httponly=True,
                       samesite="lax")
    return resp


@router.get("/portal/oidc/login", dependencies=[portal_access(Policy.PUBLIC)])
def oidc_login(request: Request, tenant: str | None = None, next: str | None = None) -> Response:
    """Send the browser to the provider (authorization code with PKCE); ``tenant`` picks one when the
    user belongs to several."""
    try:
        p = provider(request)
        endpoint = str(p.meta()["authorization_endpoint"])
    except (SignInFailed, KeyError) as e:
        return _failed(request, str(e), 503)
    verifier, nonce = secrets.token_urlsafe(48), secrets.token_urlsafe(24)
    client = p.client(str(request.url_for("oidc_callback")))
    url, state = client.create_authorization_url(endpoint, nonce=nonce, code_verifier=verifier)
    cookie = sign(portal_key(request), {"state": state, "nonce": nonce, "verifier": verifier,
                                        "tenant": tenant[:24] if tenant else None, "next": safe_next(next, ""),
                                        "exp": int(time.time()) + STATE_S})
    resp = RedirectResponse(url, status_code=303)
    resp.set_cookie(STATE_COOKIE, cookie, max_age=STATE_S, httponly=True, samesite="lax", path="/portal/oidc",
                    secure=secure_cookies(request))
    return resp


@router.get("/portal/oidc/callback", name="oidc_callback", dependencies=[portal_access(Policy.PUBLIC)])
def oidc_callback(request: Request, session: SessionDep, code: str | None = None, state: str | None = None,
                  error: str | None = None, error_description: str | None = None) -> Response:
    """Finish the sign-on: check the state, exchange the code, verify the ID token, sign the person in,
    open the portal session; the sign-in page with the reason otherwise."""
    saved = unsign(portal_key(request), request.cookies.get(STATE_COOKIE))
    if error:
        return _failed(request, f"the provider said {error}: {(error_description or '')[:200]}")
    if saved is None or not state or not code or not secrets.compare_digest(str(saved.get("state")), state):
        return _failed(request, "this sign-on answer does not belong to a sign-in started here (or it took over "
                                "10 minutes): start again", 400)
    settings: Settings = request.app.state.settings
    try:
        p = provider(request)
        client = p.client(str(request.url_for("oidc_callback")))
        try:
            tokens = client.fetch_token(str(p.meta()["token_endpoint"]), grant_type="authorization_code",
                                        code=code, code_verifier=str(saved["verifier"]))
        except Exception as e:       # authlib raises OAuthError or httpx errors: the provider refused
            raise SignInFailed(f"the provider refused the code ({type(e).__name__}: {str(e)[:200]})") from None
        if "id_token" not in tokens:
            raise SignInFailed("the provider sent no ID token (is the 'openid' scope allowed?)")
        claims = p.verify(str(tokens["id_token"]), str(saved["nonce"]))
        if settings.oidc_username_claim not in claims and tokens.get("access_token"):
            claims = {**p.userinfo(str(tokens["access_token"]), str(claims.get("sub"))), **claims}
        username, uid = unix_user(settings, claims)
    except SignInFailed as e:
        return _failed(request, str(e))
    try:
        done = signin.person_sign_in(session=session, username=username, uid=uid, via="oidc",
                                     tenant=saved.get("tenant"), now=now_for(request, session),
                                     ttl=timedelta(seconds=SESSION_S), service_user=settings.service_user)
    except ServiceError as e:
        picks = sorted(members.tenants_of(session, username)) if e.code == "pick_tenant" else None
        message = f"you belong to several tenants ({', '.join(picks)}): choose one below" if picks else e.message
        return _failed(request, message, e.status, picks)
    row = session.get(ApiToken, done.token.id)
    assert row is not None
    target = str(saved.get("next") or "/portal/jobs")
    page = (f'<!doctype html><meta http-equiv="refresh" content="0;url={html.escape(target)}">'
            f'<title>Signed in</title><p>Signed in as {html.escape(username)} ({html.escape(done.role.value)} of '
            f'{html.escape(done.tenant)}). <a href="{html.escape(target)}">Continue</a></p>')
    resp = HTMLResponse(page)
    resp.set_cookie(COOKIE, open_session(session, portal_key(request), row), **cookie_args(request, SESSION_S))
    resp.delete_cookie(STATE_COOKIE, path="/portal/oidc", secure=secure_cookies(request), httponly=True,
                       samesite="lax")
    return resp
