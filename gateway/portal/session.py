"""Portal sessions: a signed cookie naming a server-side session row, and CSRF tokens.

The cookie holds ``{session id, token id, a prefix of the token's hash, CSRF token, expiry}``
signed with HMAC-SHA256. The signing key is generated once into a 0600 file in
the gateway's state dir (never a built-in default). Every request re-reads the session row
and the token row: signing out deletes the session row (``portal_sessions``, which stores
only the id's sha256), so replaying the old cookie is refused by every gateway process
(``--workers N`` included); revoking the token ends its portal sessions at once.

Why a table and not a revocation list: a session counts only while the server knows it
(an allow-list), so a forged or replayed cookie also needs a live row, and sign-out is one
DELETE. The cost is one primary-key read per portal page; the API's routes never read it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from sqlmodel import Session

from gateway.access.tokens import Principal, principal_of
from gateway.config import Settings
from gateway.errors import BadSetting, CsrfRefused, ServiceError
from gateway.models import ApiToken, PortalSession, Role
from gateway.services.portal_sessions import end_session, record_session

COOKIE = "sft_portal"
LOGIN_COOKIE = "sft_portal_login"
SESSION_S = 12 * 3600
LOGIN_S = 3600
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"
SECURE_MODES = ("auto", "always", "never")     # Settings.cookie_secure


class NeedLogin(Exception):
    """No valid session: the route answers with a redirect to the sign-in page."""


@dataclass(frozen=True)
class PortalUser:
    principal: Principal
    csrf: str

    @property
    def is_admin(self) -> bool:
        """Whether the user signed in with a sysadmin token."""
        return self.principal.role is Role.SYSADMIN

    @property
    def label(self) -> str:
        """Who the user is, for the page header: ``[<person> · ]<tenant> (<role>)``, or just the role."""
        p = self.principal
        who = f"{p.person} · " if p.person else ""
        return f"{who}{p.tenant_name} ({p.role.value})" if p.tenant_name else p.role.value


def secret_path(settings: Settings) -> Path:
    """In the gateway's own state dir (``SFT_STATE_DIR``, 0700, the service user's), never in the
    tenant storage the gateway no longer reads itself."""
    return settings.state_dir / "portal-secret"


def load_secret(settings: Settings) -> bytes:
    """The signing key, created on first use (0600, atomically: concurrent gateways agree)."""
    path = secret_path(settings)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        parent = os.stat(path.parent)
        if os.geteuid() == 0 and parent.st_uid != 0:
            # root (tests, the demo) making it in the service user's state dir: the dropped gateway reads it
            os.fchown(f.fileno(), parent.st_uid, parent.st_gid)
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)     # fails if another process won the race: then its key is used
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip()
    except PermissionError:
        raise ServiceError(f"{path} is not readable by the gateway's user: chown it to the service user "
                           "(or delete it to have a new one made)", code="insecure_secret") from None
    if mode & 0o077:
        raise ServiceError(f"{path} is readable by others: chmod 600 it", code="insecure_secret")
    if len(key) < 32:
        raise ServiceError(f"{path} holds no usable key: delete it to have a new one made",
                           code="insecure_secret")
    return key.encode()


def sign(key: bytes, payload: dict[str, Any]) -> str:
    """``payload`` as a cookie value: base64url JSON, a dot, and its HMAC-SHA256 under ``key`` (hex)."""
    body = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).decode().rstrip("=")
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    return f"{body}.{mac}"


def unsign(key: bytes, value: str | None) -> dict[str, Any] | None:
    """The payload of a cookie signed with ``key`` and not expired, else None."""
    if not value or "." not in value or len(value) > 4096:
        return None
    body, mac = value.rsplit(".", 1)
    if not hmac.compare_digest(mac, hmac.new(key, body.encode(), hashlib.sha256).hexdigest()):
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("exp"), int) or payload["exp"] < time.time():
        return None
    return payload


def _sid_hash(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def open_session(session: Session, key: bytes, token: ApiToken) -> str:
    """Record a new portal session for ``token`` and return its signed cookie value.

    Commits, so the session exists before the browser follows the sign-in redirect
    (possibly to another worker). Sessions past their expiry are pruned on the way.
    """
    assert token.id is not None
    sid = secrets.token_urlsafe(32)
    now = datetime.now(UTC)
    exp = int(now.timestamp()) + SESSION_S
    record_session(session, id_hash=_sid_hash(sid), token_id=token.id, now=now, ttl_s=SESSION_S)
    return sign(key, {"sid": sid, "tid": token.id, "th": token.token_hash[:16],
                      "csrf": secrets.token_urlsafe(24), "exp": exp})


def close_session(session: Session, payload: dict[str, Any]) -> None:
    """End the session of a (verified) cookie payload: its cookie is refused from now on."""
    sid = payload.get("sid")
    if isinstance(sid, str):
        end_session(session, id_hash=_sid_hash(sid))


def new_login_cookie(key: bytes) -> tuple[str, str]:
    """(cookie value, CSRF token) for the sign-in form, before any session exists."""
    csrf = secrets.token_urlsafe(24)
    return sign(key, {"csrf": csrf, "exp": int(time.time()) + LOGIN_S}), csrf


def principal_for(session: Session, payload: dict[str, Any]) -> Principal | None:
    """The principal of a session payload; None once signed out, expired, or its token revoked."""
    sid, tid = payload.get("sid"), payload.get("tid")
    if not isinstance(sid, str) or not isinstance(tid, int):
        return None
    live = session.get(PortalSession, _sid_hash(sid))
    if live is None or live.token_id != tid or live.expires_at <= datetime.now(UTC):
        return None
    row = session.get(ApiToken, tid)
    if row is None or not hmac.compare_digest(row.token_hash[:16], str(payload.get("th", ""))):
        return None
    return principal_of(session, row)     # revoked, expired, or its person left the tenant: None


def session_payload(request: Request) -> dict[str, Any] | None:
    """The verified, unexpired payload of this request's session cookie (not checked against the DB)."""
    return unsign(portal_key(request), request.cookies.get(COOKIE))


def current_user(request: Request, session: Session) -> PortalUser:
    """The signed-in user of this request. Raises NeedLogin."""
    payload = session_payload(request)
    principal = principal_for(session, payload) if payload else None
    if payload is None or principal is None:
        raise NeedLogin()
    return PortalUser(principal, str(payload["csrf"]))


def check_csrf(expected: str, given: str | None) -> None:
    """Raises CsrfRefused (403) unless ``given`` is this session's CSRF token."""
    if not given or not hmac.compare_digest(expected.encode(), given.encode()):
        raise CsrfRefused("the form's security token is missing or stale: reload the page and try again")


def portal_key(request: Request) -> bytes:
    """The cookie signing key, loaded (or created) once per app by ``load_secret``."""
    state = request.app.state
    key = getattr(state, "portal_key", None)
    if key is None:
        key = load_secret(state.settings)
        state.portal_key = key
    return key  # type: ignore[no-any-return]


def secure_cookies(request: Request) -> bool:
    """Whether cookies get ``Secure``: ``SFT_COOKIE_SECURE`` = auto (only when this request came
    over TLS), always (a TLS-terminating proxy in front speaks plain HTTP to us), never."""
    mode = request.app.state.settings.cookie_secure
    if mode == "always":
        return True
    if mode == "never":
        return False
    if mode != "auto":
        raise BadSetting(f"SFT_COOKIE_SECURE is {mode!r}: set it to one of {', '.join(SECURE_MODES)}")
    return bool(request.url.scheme == "https")


def cookie_args(request: Request, max_age: int) -> dict[str, Any]:
    """``set_cookie`` arguments for a portal cookie: HttpOnly, SameSite=Strict, path /portal, Secure per
    ``secure_cookies``."""
    return {"max_age": max_age, "httponly": True, "samesite": "strict", "path": "/portal",
            "secure": secure_cookies(request)}
