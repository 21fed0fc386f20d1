"""Access policy: which roles a route admits, and whether a staff grant covers a read.

Every route of the app declares exactly one policy by carrying a dependency marked
with ``declares`` (the API flavour lives in gateway.api.deps, the portal one in
gateway.portal.web). ``undeclared_routes`` lists routes that declare none, and a test
fails on any: a route added later without an access decision cannot ship.

The grant decision (``decide``) is a pure function over the caller's requests for one
resource and the current time, so the window, revocation and exact-resource rules are
tested without a database.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from gateway.models import TENANT_ROLES, Role


class Policy(StrEnum):
    PUBLIC = "public"                # no token (sign-in page, health, static assets)
    AUTHENTICATED = "authenticated"  # any valid token; the route shows no tenant content to non-tenants
    TENANT = "tenant"                # member or tenant_admin, scoped to its own tenant
    TENANT_ADMIN = "tenant-admin"    # tenant_admin of its own tenant
    STAFF = "staff"                  # staff or sysadmin: metadata and their own access requests
    STAFF_GRANT = "staff-grant"      # staff or sysadmin, content only under an approved grant, audited
    SYSADMIN = "sysadmin"


ROLES: dict[Policy, frozenset[Role]] = {
    Policy.PUBLIC: frozenset(Role),
    Policy.AUTHENTICATED: frozenset(Role),
    Policy.TENANT: TENANT_ROLES,
    Policy.TENANT_ADMIN: frozenset({Role.TENANT_ADMIN}),
    Policy.STAFF: frozenset({Role.STAFF, Role.SYSADMIN}),
    Policy.STAFF_GRANT: frozenset({Role.STAFF, Role.SYSADMIN}),
    Policy.SYSADMIN: frozenset({Role.SYSADMIN}),
}
OPERATOR_ROLES = frozenset({Role.STAFF, Role.SYSADMIN})


def admits(policy: Policy, role: Role) -> bool:
    """Whether a token of ``role`` may call a route declared with ``policy``."""
    return role in ROLES[policy]


def refusal(policy: Policy, role: Role) -> str:
    """The message for a refused role: what the route needs and where to go instead."""
    if policy in (Policy.TENANT, Policy.TENANT_ADMIN) and role in OPERATOR_ROLES:
        return (f"this route needs a tenant token ({' or '.join(sorted(ROLES[policy]))}); {role.value} "
                "tokens see metadata under /v1/staff/ and content only through an approved access request")
    return f"this route needs a {' or '.join(sorted(r.value for r in ROLES[policy]))} token, not {role.value}"


MARK = "__access_policy__"


def declares(fn: Any, policy: Policy | str) -> Any:
    """Mark the dependency ``fn`` as the declaration (and enforcement) of ``policy``."""
    setattr(fn, MARK, Policy(policy))
    return fn


# ------------------------------------------------- reads with operator-minted tokens
# Tenant routes that show the tenant's access bookkeeping, not its data: not audited as reads.
NOT_TENANT_DATA = frozenset({"/v1/tokens", "/v1/audit", "/v1/access-requests", "/portal/access"})
READ_METHODS = frozenset({"GET", "HEAD"})
_READ_POLICIES = frozenset({Policy.TENANT, Policy.TENANT_ADMIN, Policy.AUTHENTICATED})


def tenant_read(policy: Policy, method: str, route: str) -> str | None:
    """The audit action (``read.<route's words>``) when a tenant token's request to ``route``
    (the path template, e.g. ``/v1/files/{file_id}/content``) reads the tenant's data: files and
    their content, jobs, their events and checkpoints, models and artifacts, sweeps, lists of
    them; any GET of a tenant route not in NOT_TENANT_DATA, so a new route is a read until
    reviewed. None otherwise (writes, the token, audit and access-request views)."""
    if method.upper() not in READ_METHODS or policy not in _READ_POLICIES or route in NOT_TENANT_DATA:
        return None
    words = [w for w in route.removeprefix("/v1/").split("/") if w and not w.startswith("{")]
    return ("read." + ".".join(words or ["root"]))[:40]


# ------------------------------------------------------------- route declarations
def _policies(dependant: Any) -> set[Policy]:
    found: set[Policy] = set()
    for dep in getattr(dependant, "dependencies", []):
        policy = getattr(dep.call, MARK, None)
        if policy is not None:
            found.add(policy)
        found |= _policies(dep)
    return found


def iter_routes(routes: Iterable[Any], prefix: str = "",
                deps: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any, tuple[Any, ...]]]:
    """(full path, route, dependencies added by include_router) for every route, recursing
    into included routers (FastAPI keeps them as lazy ``_IncludedRouter`` entries)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            ctx = route.include_context
            yield from iter_routes(inner.routes, prefix + ctx.prefix, deps + tuple(ctx.dependencies))
        else:
            yield prefix + getattr(route, "path", "?"), route, deps


def route_policy(route: Any, include_deps: Iterable[Any] = ()) -> Policy | None:
    """The one policy a route declares; None when it declares none or several."""
    if getattr(route, "access", None) is not None:     # plain routes and mounts: an attribute
        return Policy(route.access)
    found = {getattr(d.dependency, MARK) for d in include_deps if hasattr(d.dependency, MARK)}
    dependant = getattr(route, "dependant", None)
    found |= _policies(dependant) if dependant is not None else set()
    return found.pop() if len(found) == 1 else None


def framework_paths(app: Any) -> set[str]:
    """FastAPI's own documentation routes: public by nature, declared by the app's settings."""
    paths = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    return {p for p in paths if p}


def _label(path: str, route: Any) -> str:
    return f"{','.join(sorted(getattr(route, 'methods', None) or ['MOUNT']))} {path}"


def routes_by_policy(app: Any) -> dict[str, Policy | None]:
    """``METHODS path`` → declared policy (None: undeclared) for every route and mount."""
    known = framework_paths(app)
    out: dict[str, Policy | None] = {}
    for path, route, deps in iter_routes(app.routes):
        if path in known and getattr(route, "dependant", None) is None:
            out[_label(path, route)] = Policy.PUBLIC
        else:
            out[_label(path, route)] = route_policy(route, deps)
    return out


def undeclared_routes(app: Any) -> list[str]:
    """``METHODS path`` of every route (and mount) with no single declared policy."""
    return [label for label, policy in routes_by_policy(app).items() if policy is None]


# ----------------------------------------------------------------- access requests
class RequestStatus(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    REVOKED = "revoked"


RESOURCE_KINDS = ("job", "file")
MAX_GRANT_S = 7 * 24 * 3600
_RESOURCE = re.compile(r"^(job|file):([A-Za-z0-9_-]{1,40})$")
_DURATION = re.compile(r"^(\d{1,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class AccessError(ValueError):
    """Bad input to an access request: the message names the field and what is valid."""


def parse_resource(text: str) -> tuple[str, str]:
    """``job:ID`` or ``file:ID`` → (kind, id). Raises AccessError."""
    m = _RESOURCE.match(text.strip())
    if not m:
        raise AccessError(f"resource {text!r}: expected job:ID or file:ID (e.g. job:ftjob-abc123)")
    return m.group(1), m.group(2)


def parse_duration(text: str | int) -> int:
    """``90m``, ``2h``, ``1d`` (or seconds as an int) → seconds, 60 s to 7 days. Raises AccessError."""
    if isinstance(text, int):
        seconds = text
    else:
        m = _DURATION.match(text.strip().lower())
        if not m:
            raise AccessError(f"duration {text!r}: expected a number and a unit s, m, h or d (e.g. 2h)")
        seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
    if not 60 <= seconds <= MAX_GRANT_S:
        raise AccessError(f"duration {text!r}: must be between 1 minute and {MAX_GRANT_S // 86400} days")
    return seconds


@dataclass(frozen=True)
class GrantView:
    """What the decision needs of one access request."""

    id: str
    status: str
    created_at: datetime
    approved_at: datetime | None
    expires_at: datetime | None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    grant_id: str | None
    reason: str


def request_state(g: GrantView, now: datetime) -> str:
    """pending | denied | revoked | approved (not yet started, unusual) | active | expired."""
    if g.status != RequestStatus.APPROVED:
        return g.status
    if g.expires_at is not None and now >= g.expires_at:
        return "expired"
    if g.approved_at is not None and now < g.approved_at:
        return "approved"
    return "active"


def decide(requests: Sequence[GrantView], now: datetime, resource: str) -> Decision:
    """Allowed only under an approved, unrevoked request whose window holds ``now``.

    ``requests`` are the caller's own requests for exactly this resource; when none is
    usable the reason names the newest one's state (pending, denied, expired, revoked).
    """
    for g in requests:
        if request_state(g, now) == "active":
            return Decision(True, g.id, f"grant {g.id} active until {g.expires_at}")
    if not requests:
        return Decision(False, None, f"no access request of yours covers {resource}")
    newest = max(requests, key=lambda g: g.created_at)
    state = request_state(newest, now)
    return Decision(False, newest.id, f"access request {newest.id} for {resource} is {state}")


def grant_views(rows: Iterable[Any]) -> list[GrantView]:
    """A GrantView of each access request row (its ``decided_at`` as ``approved_at``)."""
    return [GrantView(r.id, r.status, r.created_at, r.decided_at, r.expires_at) for r in rows]
