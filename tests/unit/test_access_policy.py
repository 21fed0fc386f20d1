"""Every route declares an access policy; the grant decision is exact about resource and window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import APIRouter, Depends, FastAPI

from gateway.access.policy import (
    AccessError,
    GrantView,
    Policy,
    admits,
    decide,
    parse_duration,
    parse_resource,
    routes_by_policy,
    tenant_read,
    undeclared_routes,
)
from gateway.api.deps import access
from gateway.app import create_app
from gateway.config import Settings
from gateway.models import Role

NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)
# Routes open to operators (staff, sysadmin) that are not grant-checked: metadata only.
# A new one must be reviewed for content and added here.
OPERATOR_METADATA_ROUTES = {
    "GET /v1/models", "GET /v1/models/{model_id:path}", "POST /portal/logout",
    "GET /v1/staff/tenants/{tenant}/{kind}", "POST /v1/staff/access-requests", "GET /v1/staff/access-requests",
    "GET /portal/admin", "GET /portal/admin/usage", "GET /portal/admin/tenants",
    "GET /metrics",           # counts, ages and rates by tenant and job id: metadata, never content
    "GET /v1/me",             # the calling token itself: its role, tenant, person and expiry
}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    root: Path = tmp_path_factory.mktemp("app")
    return create_app(Settings(storage_root=root, database_url=f"sqlite:///{root / 'gw.db'}"),
                      run_migrations=False, reconcile=False)


def test_every_route_of_the_app_declares_its_policy(app: FastAPI) -> None:
    assert undeclared_routes(app) == []
    table = routes_by_policy(app)
    assert len(table) > 40, "the enumeration must see the included API and portal routers"
    assert table["GET /v1/files/{file_id}/content"] is Policy.TENANT
    assert table["GET /portal/files/{file_id}/download"] is Policy.TENANT
    assert table["GET /v1/staff/files/{file_id}/content"] is Policy.STAFF_GRANT
    # tenants list their tokens; their admin mints and revokes; any tenant token rotates itself
    assert table["GET /v1/tokens"] is Policy.TENANT
    assert table["POST /v1/tokens"] is Policy.TENANT_ADMIN
    assert table["POST /v1/tokens/rotate"] is Policy.TENANT
    assert table["POST /v1/tokens/claim"] is Policy.TENANT
    assert table["POST /v1/tokens/{token_id}/revoke"] is Policy.TENANT_ADMIN
    # only the tenant's admin asks for (and withdraws, and follows) the tenant's deletion
    for method in ("POST", "GET", "DELETE"):
        assert table[f"{method} /v1/tenant/deletion_request"] is Policy.TENANT_ADMIN


def test_operators_reach_content_only_through_grant_checked_routes(app: FastAPI) -> None:
    open_to_operators = {label for label, policy in routes_by_policy(app).items()
                         if policy not in (None, Policy.PUBLIC, Policy.STAFF_GRANT)
                         and (admits(policy, Role.STAFF) or admits(policy, Role.SYSADMIN))}
    assert open_to_operators == OPERATOR_METADATA_ROUTES


def test_a_route_added_without_a_policy_is_caught(tmp_path: Path) -> None:
    fresh = create_app(Settings(storage_root=tmp_path, database_url=f"sqlite:///{tmp_path / 'gw.db'}"),
                       run_migrations=False, reconcile=False)
    assert undeclared_routes(fresh) == []

    @fresh.get("/v1/files/{file_id}/peek")
    def peek(file_id: str) -> str:
        return file_id

    sub = APIRouter(prefix="/v1/debug")

    @sub.get("/dump")
    def dump() -> None:
        return None

    fresh.include_router(sub, prefix="/x")

    @fresh.get("/ambiguous", dependencies=[access(Policy.TENANT), access(Policy.STAFF)])
    def ambiguous() -> None:
        return None

    @fresh.get("/declared", dependencies=[Depends(lambda: None), access(Policy.SYSADMIN)])
    def declared() -> None:
        return None

    fresh.add_route("/plain", lambda request: None)
    assert undeclared_routes(fresh) == ["GET /v1/files/{file_id}/peek", "GET /x/v1/debug/dump",
                                        "GET /ambiguous", "GET,HEAD /plain"]


def test_router_level_declarations_cover_included_routes() -> None:
    sub = APIRouter(prefix="/v1/thing", dependencies=[access(Policy.TENANT)])

    @sub.get("/{thing_id}")
    def get_thing(thing_id: str) -> str:
        return thing_id

    app = FastAPI()
    outer = APIRouter()
    outer.include_router(sub)
    app.include_router(outer, dependencies=[])
    assert undeclared_routes(app) == []
    assert routes_by_policy(app)["GET /v1/thing/{thing_id}"] is Policy.TENANT


@pytest.mark.parametrize("role,policy,ok", [
    (Role.MEMBER, Policy.TENANT, True), (Role.STAFF, Policy.TENANT, False), (Role.SYSADMIN, Policy.TENANT, False),
    (Role.MEMBER, Policy.TENANT_ADMIN, False), (Role.TENANT_ADMIN, Policy.TENANT_ADMIN, True),
    (Role.STAFF, Policy.STAFF_GRANT, True), (Role.SYSADMIN, Policy.STAFF_GRANT, True),
    (Role.TENANT_ADMIN, Policy.STAFF_GRANT, False), (Role.STAFF, Policy.SYSADMIN, False),
])
def test_roles_per_policy(role: Role, policy: Policy, ok: bool) -> None:
    assert admits(policy, role) is ok


def grant(status: str, *, approved: datetime | None = NOW, hours: float = 1, created: datetime = NOW,
          gid: str = "acr-1") -> GrantView:
    return GrantView(gid, status, created, approved if status != "pending" else None,
                     approved + timedelta(hours=hours) if approved and status in ("approved", "revoked") else None)


@pytest.mark.parametrize("requests,at,allowed,word", [
    ([], NOW, False, "no access request"),
    ([grant("pending")], NOW, False, "pending"),
    ([grant("denied")], NOW, False, "denied"),
    ([grant("revoked")], NOW, False, "revoked"),
    ([grant("approved")], NOW, True, "active"),
    ([grant("approved")], NOW + timedelta(minutes=59, seconds=59), True, "active"),
    ([grant("approved")], NOW + timedelta(hours=1), False, "expired"),
    ([grant("approved")], NOW - timedelta(seconds=1), False, "approved"),   # before the window
    ([grant("approved", hours=1), grant("pending", created=NOW + timedelta(hours=2), gid="acr-2")],
     NOW + timedelta(hours=3), False, "acr-2 for job:x is pending"),
    ([grant("denied"), grant("approved", gid="acr-2")], NOW, True, "acr-2"),
])
def test_decide(requests: list[GrantView], at: datetime, allowed: bool, word: str) -> None:
    d = decide(requests, at, "job:x")
    assert d.allowed is allowed and word in d.reason


def test_parse_resource_and_duration() -> None:
    assert parse_resource("job:ftjob-abc") == ("job", "ftjob-abc")
    assert parse_resource(" file:file-1 ") == ("file", "file-1")
    assert parse_duration("2h") == 7200 and parse_duration("90m") == 5400 and parse_duration("1d") == 86400
    for bad in ("tenant:x", "job:", "job:../x", "file:a b"):
        with pytest.raises(AccessError, match="job:ID or file:ID"):
            parse_resource(bad)
    for bad in ("2", "2w", "30s", "8d", "-1h"):
        with pytest.raises(AccessError, match="duration"):
            parse_duration(bad)


def test_which_requests_are_reads_of_tenant_data(app: FastAPI) -> None:
    """Every GET of a tenant route is a read (audited for operator-minted tokens) unless it is one of
    the tenant's access views; writes and operator-only routes are not."""
    assert tenant_read(Policy.TENANT, "GET", "/v1/files/{file_id}/content") == "read.files.content"
    assert tenant_read(Policy.TENANT, "GET", "/v1/fine_tuning/jobs/{job_id}/events") == "read.fine_tuning.jobs.events"
    assert tenant_read(Policy.TENANT, "GET", "/v1/fine_tuning/jobs") == "read.fine_tuning.jobs"
    assert tenant_read(Policy.AUTHENTICATED, "GET", "/v1/models/{model_id:path}") == "read.models"
    assert tenant_read(Policy.TENANT, "HEAD", "/v1/files") == "read.files"
    for policy, method, route in ((Policy.TENANT, "POST", "/v1/files"), (Policy.TENANT, "GET", "/v1/tokens"),
                                  (Policy.TENANT, "GET", "/v1/audit"), (Policy.TENANT, "GET", "/v1/access-requests"),
                                  (Policy.STAFF_GRANT, "GET", "/v1/staff/files/{file_id}/content"),
                                  (Policy.PUBLIC, "GET", "/healthz"), (Policy.SYSADMIN, "GET", "/metrics")):
        assert tenant_read(policy, method, route) is None, route
    reads = {label for label, policy in routes_by_policy(app).items()
             if policy is not None and label.startswith("GET /v1/")
             and tenant_read(policy, "GET", label.removeprefix("GET ")) is not None}
    assert {"GET /v1/files/{file_id}/content", "GET /v1/fine_tuning/jobs/{job_id}/events",
            "GET /v1/fine_tuning/jobs", "GET /v1/files"} <= reads
    assert not any("/staff/" in r or "/tokens" in r for r in reads)
