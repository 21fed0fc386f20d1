"""Staff access on a real database: operators read tenant content only under the tenant
admin's approval of exactly that resource, inside its window; every attempt is audited."""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from gateway.access.tokens import operator_mint
from gateway.config import get_settings
from gateway.models import AuditEntry, DataFile, FineTuningJob, JobEvent, Role, Tenant
from gateway.services.tenants import get_tenant
from gateway.storage import storage_for
from gateway.storage.layout import result_path, tenant_root
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, chat_lines

pytestmark = pytest.mark.service
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
SECRET_EVENT = "eval sample: the canary answer is 4242"


@dataclass
class World:
    gw: Gateway
    clock: dict[str, datetime]
    file: str                   # tenant A's dataset
    file2: str                  # another dataset of tenant A
    job: str                    # tenant A's job with events and a result file
    job2: str
    result: str                 # the job's result file
    data: bytes
    result_bytes: bytes
    tokens: dict[str, str] = field(default_factory=dict)

    def token(self, name: str, role: Role, tenant: str | None = None, claim: bool = True) -> str:
        """A token as the admin CLI mints it; a tenant_admin one is then claimed by its holder
        with the one-time code the mint wrote into the tenant's storage (the tenant's own),
        unless ``claim`` is False (it stays operator-minted)."""
        with Session(self.gw.app.state.engine) as s:
            t = get_tenant(session=s, name=tenant) if tenant else None
            minted = operator_mint(session=s, storage=storage_for(self.gw.settings), role=role, tenant=t,
                                   name=name, now=self.clock["now"])
            s.commit()
        self.tokens[name] = minted.secret
        if role is Role.TENANT_ADMIN and claim:
            assert minted.claim_file, "the tenant has an admin of its own: no claim code"
            r = self.gw.client.post("/v1/tokens/claim", headers=self.h(name),
                                    json={"code": claim_code_in(minted.claim_file)})
            assert r.status_code == 201 and r.json()["decides_access"], r.text
            self.tokens[name] = r.json()["token"]
        return self.tokens[name]

    def h(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens.get(who) or self.gw.tokens[who]}"}

    def advance(self, **kw: float) -> None:
        self.clock["now"] += timedelta(**kw)

    def request(self, who: str, resource: str, duration: str = "2h") -> str:
        r = self.gw.client.post("/v1/staff/access-requests", headers=self.h(who), json={
            "tenant": TENANT_A, "resource": resource, "reason": "ticket 42: loss is NaN", "duration": duration})
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "pending"
        return str(r.json()["id"])

    def decide(self, req: str, action: str, who: str = "admin-a") -> dict[str, Any]:
        r = self.gw.client.post(f"/v1/access-requests/{req}/{action}", headers=self.h(who))
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def audit_count(self, token: str) -> int:
        with Session(self.gw.app.state.engine) as s:
            tid = token_id(s, token)
            return int(s.exec(select(func.count()).select_from(AuditEntry)
                              .where(AuditEntry.actor_token_id == tid)).one())

    def last_audit(self, token: str) -> AuditEntry:
        with Session(self.gw.app.state.engine) as s:
            tid = token_id(s, token)
            row = s.exec(select(AuditEntry).where(AuditEntry.actor_token_id == tid)
                         .order_by(AuditEntry.seq.desc())).first()  # type: ignore[attr-defined]
            assert row is not None
            return row


def claim_code_in(path: str) -> str:
    """The claim code in a CLAIM-CODE file (the test runs as root, which can read it)."""
    found = re.findall(r"sftclaim_[A-Za-z0-9_-]+", Path(path).read_text())
    assert len(found) == 1, found
    return str(found[0])


def token_id(s: Session, secret: str) -> int:
    from gateway.access.tokens import authenticate

    p = authenticate(session=s, token=secret)
    assert p is not None
    return p.token_id


def _add_job(gw: Gateway, tenant: str, train: str, result_bytes: bytes) -> tuple[str, str]:
    """A finished job with events and a published result file, written as the gateway would."""
    with Session(gw.app.state.engine) as s:
        t = s.exec(select(Tenant).where(Tenant.name == tenant)).one()
        assert t.id is not None
        job = FineTuningJob(tenant_id=t.id, training_file=train, model="tiny-chat", status="succeeded",
                            slurm_job_id=4242, finished_at=T0)
        s.add(job)
        s.flush()
        rel = result_path(f"art-{secrets.token_hex(12)}", "eval.json")
        root = tenant_root(gw.settings.storage_root, tenant)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(result_bytes)
        path.chmod(0o600)
        if os.geteuid() == 0:       # the broker serves only what the tenant's unix user owns
            owner = pwd.getpwnam(f"sft-{tenant}")
            for p in (path.parent.parent, path.parent, path):
                os.chown(p, owner.pw_uid, owner.pw_gid)
        res = DataFile(tenant_id=t.id, filename=f"{job.id}-eval.json", purpose="fine-tune-results",
                       bytes=len(result_bytes), sha256="0" * 64, status="processed", path=rel, job_id=job.id)
        s.add(res)
        s.flush()
        job.result_files = [res.id]
        s.add(job)
        s.add(JobEvent(job_id=job.id, message=SECRET_EVENT))
        s.commit()
        return job.id, res.id


@pytest.fixture(autouse=True)
def audit_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test's gateway signs its audit head with a key file of its own."""
    path = tmp_path / "gateway-state" / "audit.key"
    monkeypatch.setenv("SFT_AUDIT_KEY_FILE", str(path))
    get_settings.cache_clear()
    yield path
    get_settings.cache_clear()


@pytest.fixture
def world(gw: Gateway, audit_key: Path) -> World:
    clock = {"now": T0}
    gw.app.state.clock = lambda _db: clock["now"]
    data = chat_lines(12)
    f1 = gw.upload(TENANT_A, data).json()["id"]
    f2 = gw.upload(TENANT_A, chat_lines(13, start=50)).json()["id"]
    result_bytes = json.dumps({"samples": ["canary 4242"]}).encode()
    job, result = _add_job(gw, TENANT_A, f1, result_bytes)
    job2, _ = _add_job(gw, TENANT_A, f2, b"{}")
    w = World(gw, clock, f1, f2, job, job2, result, data, result_bytes)
    w.token("admin-a", Role.TENANT_ADMIN, TENANT_A)
    w.token("admin-b", Role.TENANT_ADMIN, TENANT_B)
    return w


# ------------------------------------------------------------------ the matrix
SCENARIOS = ["no grant", "pending", "denied", "expired", "revoked", "grant for another resource",
             "another operator's grant", "grant for this resource"]


def content_routes(w: World) -> list[tuple[str, str, bytes | None]]:
    """(route, resource it needs, bytes an allowed read returns; None = never allowed)."""
    return [
        (f"/v1/staff/files/{w.file}/content", f"file:{w.file}", w.data),
        (f"/v1/staff/jobs/{w.job}/events", f"job:{w.job}", SECRET_EVENT.encode()),
        (f"/v1/staff/jobs/{w.job}/results/{w.result}", f"job:{w.job}", w.result_bytes),
        (f"/v1/files/{w.file}/content", f"file:{w.file}", None),
        (f"/v1/files/{w.result}/content", f"file:{w.result}", None),
        (f"/v1/fine_tuning/jobs/{w.job}/events", f"job:{w.job}", None),
        (f"/v1/files/{w.file}", f"file:{w.file}", None),
        (f"/v1/fine_tuning/jobs/{w.job}", f"job:{w.job}", None),
    ]


def setup_scenario(w: World, scenario: str, who: str, role: Role) -> None:
    """Bring operator ``who`` into ``scenario`` for file:F and job:J of tenant A."""
    mine = [f"file:{w.file}", f"job:{w.job}"]
    if scenario == "no grant":
        return
    if scenario == "grant for another resource":
        for res in (f"file:{w.file2}", f"job:{w.job2}", f"file:{w.result}"):
            w.decide(w.request(who, res), "approve")
        return
    if scenario == "another operator's grant":
        other = f"{who}-colleague"
        w.token(other, role)
        for res in mine:
            w.decide(w.request(other, res), "approve")
        return
    reqs = [w.request(who, res, duration="1h") for res in mine]
    for req in reqs:
        if scenario in ("denied",):
            w.decide(req, "deny")
        elif scenario in ("expired", "revoked", "grant for this resource"):
            w.decide(req, "approve")
        if scenario == "revoked":
            w.decide(req, "revoke")
    if scenario == "expired":
        w.advance(hours=1)            # the window is [approval, approval + 1h)
    elif scenario == "grant for this resource":
        w.advance(minutes=59, seconds=59)   # still inside


@pytest.mark.parametrize("role", [Role.STAFF, Role.SYSADMIN])
def test_content_matrix(world: World, role: Role) -> None:
    w = world
    failures = []
    for n, scenario in enumerate(SCENARIOS):
        who = f"{role.value}-{n}"
        token = w.token(who, role)
        setup_scenario(w, scenario, who, role)
        for route, resource, content in content_routes(w):
            before = w.audit_count(token)
            r = w.gw.client.get(route, headers=w.h(who))
            allowed = scenario == "grant for this resource" and content is not None
            ok = r.status_code == 200 if allowed else r.status_code in (403, 404)
            if allowed and content not in r.content:
                ok = False
            if not allowed and (SECRET_EVENT.encode() in r.content or b"What is" in r.content
                                or b"canary" in r.content):
                ok = False
            entry = w.last_audit(token)
            logged = w.audit_count(token) == before + 1 and entry.outcome == ("allowed" if allowed else "denied") \
                and entry.resource == resource and (entry.tenant == TENANT_A)
            if not (ok and logged):
                failures.append(f"{scenario:>26} | {route}: HTTP {r.status_code}, audit +"
                                f"{w.audit_count(token) - before} {entry.outcome} {entry.resource} {entry.tenant}")
            if content is not None and not allowed and scenario in ("pending", "denied", "expired", "revoked"):
                assert scenario.split()[0] in entry.reason, (scenario, entry.reason)
    assert failures == [], "\n".join(failures)


# ----------------------------------------------------------- grant lifecycle
def test_window_revocation_and_exact_resource(world: World) -> None:
    w = world
    w.token("staff", Role.STAFF)
    req = w.request("staff", f"file:{w.result}", duration="30m")
    url = f"/v1/staff/files/{w.result}/content"
    assert w.gw.client.get(url, headers=w.h("staff")).status_code == 403
    granted = w.decide(req, "approve")
    assert granted["state"] == "active" and granted["expires_at"] == int((T0 + timedelta(minutes=30)).timestamp())
    assert w.gw.client.get(url, headers=w.h("staff")).content == w.result_bytes
    # a file grant for the result is not a grant for its job (nor its other routes)
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/results/{w.result}", headers=w.h("staff")).status_code == 403
    w.advance(minutes=29)
    assert w.gw.client.get(url, headers=w.h("staff")).status_code == 200
    w.advance(minutes=1)
    r = w.gw.client.get(url, headers=w.h("staff"))
    assert r.status_code == 403 and "expired" in r.json()["error"]["message"]
    # a second grant, revoked early, stops reads at once
    req2 = w.request("staff", f"file:{w.result}", duration="2h")
    w.decide(req2, "approve")
    assert w.gw.client.get(url, headers=w.h("staff")).status_code == 200
    w.decide(req2, "revoke")
    r = w.gw.client.get(url, headers=w.h("staff"))
    assert r.status_code == 403 and "revoked" in r.json()["error"]["message"]
    # decided requests cannot be decided again
    assert w.gw.client.post(f"/v1/access-requests/{req2}/approve", headers=w.h("admin-a")).status_code == 409


def test_only_the_owning_tenant_admin_decides(world: World) -> None:
    w = world
    w.token("staff", Role.STAFF)
    req = w.request("staff", f"job:{w.job}")
    for who, status in (("admin-b", 404), (TENANT_A, 403), ("staff", 403), ("sysadmin", 403)):
        r = w.gw.client.post(f"/v1/access-requests/{req}/approve", headers=w.h(who))
        assert r.status_code == status, (who, r.text)
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/events", headers=w.h("staff")).status_code == 403
    # a request naming another tenant's resource is refused at once
    r = w.gw.client.post("/v1/staff/access-requests", headers=w.h("staff"), json={
        "tenant": TENANT_B, "resource": f"job:{w.job}", "reason": "x", "duration": "1h"})
    assert r.status_code == 404
    bad = w.gw.client.post("/v1/staff/access-requests", headers=w.h("staff"), json={
        "tenant": TENANT_A, "resource": f"job:{w.job}", "reason": "x", "duration": "9y"})
    assert bad.status_code == 400 and "duration" in bad.json()["error"]["message"]
    # tenants cannot make requests
    assert w.gw.client.post("/v1/staff/access-requests", headers=w.h("admin-a"), json={
        "tenant": TENANT_A, "resource": f"job:{w.job}", "reason": "x"}).status_code == 403


def test_metadata_view_shows_no_content(world: World) -> None:
    w = world
    w.token("staff", Role.STAFF)
    for who in ("staff", "sysadmin"):
        jobs = w.gw.client.get(f"/v1/staff/tenants/{TENANT_A}/jobs", headers=w.h(who))
        files = w.gw.client.get(f"/v1/staff/tenants/{TENANT_A}/files", headers=w.h(who))
        assert jobs.status_code == 200 and files.status_code == 200
        assert {j["id"] for j in jobs.json()["data"]} == {w.job, w.job2}
        assert {j["slurm_job_id"] for j in jobs.json()["data"]} == {4242}
        assert {f["id"] for f in files.json()["data"]} >= {w.file, w.file2, w.result}
        blob = jobs.text + files.text
        assert "What is" not in blob and "canary" not in blob and "train.jsonl" not in blob
    assert w.gw.client.get(f"/v1/staff/tenants/{TENANT_A}/jobs", headers=w.h(TENANT_A)).status_code == 403


# ---------------------------------------------------- what tenants can see
def test_tenants_see_requests_and_reads_on_their_resources_only(world: World) -> None:
    w = world
    w.token("staff", Role.STAFF)
    req = w.request("staff", f"file:{w.file}")
    w.decide(req, "approve")
    assert w.gw.client.get(f"/v1/staff/files/{w.file}/content", headers=w.h("staff")).status_code == 200
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/events", headers=w.h("staff")).status_code == 403

    a = w.gw.client.get("/v1/audit", headers=w.h(TENANT_A)).json()["data"]
    seen = {(e["action"], e["resource"], e["outcome"]) for e in a}
    assert {("access.request", f"file:{w.file}", "allowed"), ("access.approve", f"file:{w.file}", "allowed"),
            ("read.file_content", f"file:{w.file}", "allowed"),
            ("read.job_events", f"job:{w.job}", "denied")} <= seen
    assert all(e["tenant"] == TENANT_A for e in a)
    listed = w.gw.client.get("/v1/access-requests", headers=w.h(TENANT_A)).json()["data"]
    assert [r["id"] for r in listed] == [req] and listed[0]["state"] == "active"

    b = w.gw.client.get("/v1/audit", headers=w.h(TENANT_B)).json()["data"]
    assert {e["action"] for e in b} == {"token.create", "token.revoke"}, "B sees only its own tokens' history"
    assert all(e["tenant"] == TENANT_B and e["resource"].startswith("token:") for e in b)
    assert w.gw.client.get("/v1/access-requests", headers=w.h(TENANT_B)).json()["data"] == []
    assert w.gw.client.get("/v1/audit", headers=w.h("staff")).status_code == 403
    assert w.gw.client.get("/v1/audit?after=2189832612582892503040", headers=w.h(TENANT_A)).status_code == 400
    own = w.gw.client.get("/v1/staff/access-requests", headers=w.h("staff")).json()["data"]
    assert [(r["id"], r["tenant"], r["state"]) for r in own] == [(req, TENANT_A, "active")]


# ------------------------------------------------------------------ portal
def portal(gw: Gateway, token: str) -> TestClient:
    client = TestClient(gw.app, raise_server_exceptions=False)
    page = client.get("/portal/login")
    m = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert m
    r = client.post("/portal/login", data={"token": token, "csrf": m.group(1), "next": ""},
                    follow_redirects=False)
    assert r.status_code == 303, r.text
    return client


def test_portal_pages_show_operators_no_content_and_audit_them(world: World) -> None:
    w = world
    token = w.token("staff", Role.STAFF)
    w.decide(w.request("staff", f"file:{w.file}"), "approve")   # even with a grant: API only
    for who in ("staff", "sysadmin"):
        client = portal(w.gw, w.tokens.get(who) or w.gw.tokens[who])
        for page in (f"/portal/files/{w.file}/download", f"/portal/datasets/{w.file}", f"/portal/jobs/{w.job}",
                     f"/portal/jobs/{w.job}/live", "/portal/datasets", "/portal/jobs"):
            r = client.get(page, follow_redirects=False)
            assert r.status_code == 403, (who, page, r.status_code)
            assert b"What is" not in r.content and b"canary" not in r.content
    entry = w.last_audit(token)
    assert entry.outcome == "denied" and entry.action == "tenant_route" and "/portal/jobs" in entry.reason


def test_tenant_admin_approves_in_the_portal(world: World) -> None:
    w = world
    w.token("staff", Role.STAFF)
    req = w.request("staff", f"job:{w.job}")
    admin = portal(w.gw, w.tokens["admin-a"])
    page = admin.get("/portal/access")
    assert page.status_code == 200 and req in page.text and "ticket 42" in page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf
    assert admin.post(f"/portal/access/{req}/approve", data={"csrf": "wrong"}).status_code == 403
    r = admin.post(f"/portal/access/{req}/approve", data={"csrf": csrf.group(1)}, follow_redirects=False)
    assert r.status_code == 303
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/events", headers=w.h("staff")).status_code == 200
    member = portal(w.gw, w.gw.tokens[TENANT_A])
    seen = member.get("/portal/access")
    assert seen.status_code == 200 and req in seen.text and "read.job_events" in seen.text
    assert member.post(f"/portal/access/{req}/revoke", data={"csrf": csrf.group(1)}).status_code == 403
    other = portal(w.gw, w.tokens["admin-b"]).get("/portal/access")
    assert other.status_code == 200 and req not in other.text
