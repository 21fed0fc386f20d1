"""Token provenance on a real database: every mint and revocation for a tenant is in its
audit log naming who did it; tenants list their tokens; a tenant_admin token an operator
minted cannot decide staff access requests (refused, audited), and rotating it changes nothing
(claiming it needs the one-time code in the tenant's storage: tests/service/test_token_claim.py)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
from click.testing import CliRunner

from gateway.api.deps import PrincipalCache
from gateway.cli import main
from gateway.config import get_settings
from gateway.models import Role
from tests.service.conftest import TENANT_A, TENANT_B, chat_lines, cli_over
from tests.service.test_staff_access import World, audit_key, portal, world  # noqa: F401 - fixtures

pytestmark = pytest.mark.service
LOCAL = f"local admin CLI (uid {os.getuid()})"


def admin_cli(w: World, *args: str) -> tuple[int, str]:
    """`finetune admin ...` on the gateway's database, as the sysadmin at the gateway host."""
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["admin", *args], env={"SFT_DATABASE_URL": w.gw.settings.database_url,
                                                              "SFT_STORAGE_ROOT": str(w.gw.settings.storage_root)})
    finally:
        get_settings.cache_clear()
    return res.exit_code, res.output


@pytest.fixture
def w(world: World) -> World:  # noqa: F811 - the imported fixture
    return world


@pytest.fixture
def finetune(w: World, monkeypatch: pytest.MonkeyPatch) -> Any:
    return cli_over(w.gw, monkeypatch)


def audit_of(w: World, who: str) -> list[dict[str, Any]]:
    r = w.gw.client.get("/v1/audit?limit=1000", headers=w.h(who))
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def cli_mint(w: World, role: str, tenant: str = TENANT_A, name: str = "from-ops") -> dict[str, Any]:
    code, out = admin_cli(w, "token", "create", "--tenant", tenant, "--role", role, "--name", name, "--json")
    assert code == 0, out
    return json.loads(out)  # type: ignore[no-any-return]


def forget_cached_tokens(w: World) -> None:
    """The principal cache keeps a revoked token usable for token_cache_s: skip the wait."""
    w.gw.app.state.principals = None


# ------------------------------------------------------ minting is in the log
def test_every_mint_and_revocation_is_in_the_tenant_audit_log(w: World, finetune: Any) -> None:
    minted = cli_mint(w, "tenant_admin")
    assert minted["minted_by"] == LOCAL and minted["minted_by_operator"] is True
    w.tokens["ops-admin"] = minted["token"]
    entries = audit_of(w, TENANT_A)
    mint = next(e for e in entries if e["resource"] == f"token:{minted['id']}")
    assert mint["action"] == "token.create" and mint["outcome"] == "alert" and mint["tenant"] == TENANT_A
    assert mint["actor_token_id"] is None and mint["actor_role"] == "sysadmin"
    assert f"tenant_admin token #{minted['id']} 'from-ops' minted by {LOCAL}" in mint["reason"]
    assert "operator-minted" in mint["reason"] and "every read of your data made with it is audited" in mint["reason"]

    # through the API: the tenant's own admin mints and revokes; a rotation mints and revokes
    r = w.gw.client.post("/v1/tokens", headers=w.h("admin-a"), json={"role": "member", "name": "ci"})
    assert r.status_code == 201, r.text
    ci = r.json()
    assert ci["minted_by_operator"] is False and ci["minted_by"].startswith("token #")
    assert w.gw.client.post(f"/v1/tokens/{ci['id']}/revoke", headers=w.h("admin-a")).json()["revoked_at"]
    code, out = admin_cli(w, "token", "revoke", str(minted["id"]))
    assert code == 0 and "revoked" in out, out
    code, out = admin_cli(w, "token", "revoke", str(minted["id"]))
    assert code == 0 and "already revoked" in out, out

    entries = audit_of(w, TENANT_A)
    by_resource = {(e["action"], e["resource"]): e for e in entries}
    api_mint = by_resource[("token.create", f"token:{ci['id']}")]
    assert api_mint["actor_role"] == "tenant_admin" and api_mint["actor_token_id"] is not None
    assert f"member token #{ci['id']} 'ci' minted by token #{api_mint['actor_token_id']} (tenant_admin of " \
           f"{TENANT_A})" in api_mint["reason"]
    assert "revoked by token #" in by_resource[("token.revoke", f"token:{ci['id']}")]["reason"]
    cli_revoke = by_resource[("token.revoke", f"token:{minted['id']}")]
    assert f"revoked by {LOCAL}" in cli_revoke["reason"] and cli_revoke["actor_token_id"] is None
    assert sum(1 for e in entries if e["action"] == "token.revoke" and e["resource"] == f"token:{minted['id']}") == 1
    assert api_mint["outcome"] == "allowed", "the tenant's own admin's mint is no alert"
    # the world's admin token was claimed with its code: both halves are logged
    assert any(e["action"] == "token.create" and "claim of token #" in e["reason"] and "claimed" in e["reason"]
               for e in entries)
    assert any(e["action"] == "token.revoke" and "claim: replaced by token #" in e["reason"] for e in entries)
    # never a secret; other tenants see none of it; the user CLI lists it
    blob = json.dumps(entries)
    assert "sft_" not in blob
    for secret in (*w.tokens.values(), *w.gw.tokens.values(), minted["token"], ci["token"]):
        assert secret not in blob and secret[4:14] not in blob
    assert not any(e["resource"] in (f"token:{minted['id']}", f"token:{ci['id']}") for e in audit_of(w, TENANT_B))
    code, out = finetune(w.gw.tokens[TENANT_A], "audit", "list")
    assert code == 0 and "token.create" in out and LOCAL in out and "sysadmin#-" in out, out


def test_operator_tokens_mints_are_logged_but_not_shown_to_tenants(w: World) -> None:
    code, out = admin_cli(w, "token", "create", "--role", "staff", "--json")
    assert code == 0, out
    staff = json.loads(out)
    assert staff["minted_by_operator"] is True and staff["tenant"] is None
    for tenant in (TENANT_A, TENANT_B):
        assert not any(e["resource"] == f"token:{staff['id']}" for e in audit_of(w, tenant))


# ------------------------------------------------------------ tenants list
def test_tenants_list_their_tokens(w: World, finetune: Any) -> None:
    minted = cli_mint(w, "member", name="notebook")
    r = w.gw.client.get("/v1/tokens", headers=w.h(TENANT_A))
    assert r.status_code == 200, r.text
    rows = {t["id"]: t for t in r.json()["data"]}
    t = rows[minted["id"]]
    assert {k: t[k] for k in ("name", "role", "minted_by", "minted_by_operator", "revoked_at", "decides_access")} \
        == {"name": "notebook", "role": "member", "minted_by": LOCAL, "minted_by_operator": True,
            "revoked_at": None, "decides_access": False}
    assert isinstance(t["created_at"], int) and t["prefix"].startswith("sft_") and "token" not in t
    assert "token_hash" not in json.dumps(r.json()) and minted["token"] not in r.text
    admins = [t for t in rows.values() if t["role"] == "tenant_admin"]
    assert [a["decides_access"] for a in admins if a["revoked_at"] is None] == [True]
    assert any(a["revoked_at"] and a["revoked_by"] for a in admins), "the CLI-minted admin token, claimed"
    # only this tenant's tokens; operators are refused
    b_ids = {t["id"] for t in w.gw.client.get("/v1/tokens", headers=w.h(TENANT_B)).json()["data"]}
    assert b_ids and not b_ids & set(rows)
    w.token("staff", Role.STAFF)
    for who in ("staff", "sysadmin"):
        assert w.gw.client.get("/v1/tokens", headers=w.h(who)).status_code == 403
    # the user CLI
    code, out = finetune(w.gw.tokens[TENANT_A], "tokens", "list", "--json")
    assert code == 0 and {t["id"] for t in json.loads(out)["data"]} == set(rows)
    code, out = finetune(w.gw.tokens[TENANT_A], "tokens", "list")
    assert code == 0 and f"#{minted['id']}" in out and "notebook" in out and f"minted by {LOCAL} (operator)" in out
    assert "decides access" in out and minted["token"] not in out


# ------------------------------------------- operator-minted admins don't decide
def test_operator_minted_admin_token_cannot_decide_requests(w: World) -> None:
    w.token("ops-admin", Role.TENANT_ADMIN, TENANT_A, claim=False)      # what a sysadmin mints
    w.token("root", Role.SYSADMIN)
    pending = w.request("root", f"job:{w.job}")
    active = w.request("root", f"file:{w.file}")
    w.decide(active, "approve")                                         # by the tenant's own admin
    for req, action in ((pending, "approve"), (pending, "deny"), (active, "revoke")):
        r = w.gw.client.post(f"/v1/access-requests/{req}/{action}", headers=w.h("ops-admin"))
        assert r.status_code == 403, (action, r.text)
        msg = r.json()["error"]["message"]
        assert f"minted by {LOCAL}, an operator" in msg and "cannot approve, deny or revoke" in msg
        assert "finetune tokens claim" in msg
        entry = w.last_audit(w.tokens["ops-admin"])
        assert (entry.action, entry.outcome, entry.grant_id, entry.tenant) == \
            (f"access.{action}", "denied", req, TENANT_A), entry
        assert "decision refused" in entry.reason
    # nothing changed: the sysadmin still cannot read the pending one, the active grant still works
    states = {r["id"]: r["state"] for r in w.gw.client.get("/v1/access-requests", headers=w.h(TENANT_A)).json()["data"]}
    assert states == {pending: "pending", active: "active"}
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/events", headers=w.h("root")).status_code == 403
    # nor can it clear the way for a claim by revoking the tenant's own admin (refused, audited)
    own = next(t for t in w.gw.client.get("/v1/tokens", headers=w.h(TENANT_A)).json()["data"]
               if t["decides_access"])
    r = w.gw.client.post(f"/v1/tokens/{own['id']}/revoke", headers=w.h("ops-admin"))
    assert r.status_code == 403 and "cannot revoke your tenant's own token" in r.json()["error"]["message"]
    entry = w.last_audit(w.tokens["ops-admin"])
    assert (entry.action, entry.outcome, entry.resource) == ("token.revoke", "denied", f"token:{own['id']}")
    r = w.gw.client.post("/v1/tokens/rotate", headers=w.h("ops-admin"))
    assert r.status_code == 201 and r.json()["decides_access"] is False, "an own admin exists: no claim"
    w.tokens["ops-admin"] = r.json()["token"]
    # the tenant sees the refusals
    seen = {(e["action"], e["outcome"]) for e in audit_of(w, TENANT_A)}
    assert {("access.approve", "denied"), ("access.deny", "denied"), ("access.revoke", "denied"),
            ("token.revoke", "denied")} <= seen
    # the portal offers it no forms and refuses the post
    client = portal(w.gw, w.tokens["ops-admin"])
    page = client.get("/portal/access")
    assert page.status_code == 200 and pending in page.text and f"/portal/access/{pending}/approve" not in page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf
    r = client.post(f"/portal/access/{pending}/approve", data={"csrf": csrf.group(1)}, follow_redirects=False)
    assert r.status_code == 403
    own = portal(w.gw, w.tokens["admin-a"]).get("/portal/access")
    assert f"/portal/access/{pending}/approve" in own.text


def test_rotation_never_claims_an_operator_minted_admin_token(w: World) -> None:
    # tenant B's admin was claimed by the world; a second CLI-minted admin for B gets no claim code
    minted = cli_mint(w, "tenant_admin", tenant=TENANT_B)
    assert minted["claim_file"] is None and minted["claim_expires_at"] is None
    r = w.gw.client.post("/v1/tokens/rotate", headers={"Authorization": f"Bearer {minted['token']}"})
    assert r.status_code == 201, r.text
    second = r.json()
    assert second["minted_by_operator"] is True and second["decides_access"] is False
    assert second["minted_by"] == f"rotation of token #{minted['id']} by its holder"
    note = next(e for e in audit_of(w, TENANT_B) if e["resource"] == f"token:{second['id']}")["reason"]
    assert "still operator-minted" in note and "rotation claims nothing" in note
    # the old secret stops working; the new one works, but decides nothing
    forget_cached_tokens(w)
    assert w.gw.client.get("/v1/tokens", headers={"Authorization": f"Bearer {minted['token']}"}).status_code == 401
    w.tokens["ops-b"] = second["token"]
    w.token("staff", Role.STAFF)
    r = w.gw.client.post("/v1/staff/access-requests", headers=w.h("staff"), json={
        "tenant": TENANT_B, "resource": f"file:{w.gw.upload(TENANT_B, chat_lines(11)).json()['id']}",
        "reason": "ticket 9"})
    assert r.status_code == 201, r.text
    req_b = r.json()["id"]
    assert w.gw.client.post(f"/v1/access-requests/{req_b}/approve", headers=w.h("ops-b")).status_code == 403
    # a tainted admin passes its taint on; the tenant's own admin mints tokens that decide
    w.gw.app.state.principals = PrincipalCache(3600)
    r = w.gw.client.post("/v1/tokens", headers=w.h("ops-b"), json={"role": "tenant_admin", "name": "laundered"})
    assert r.status_code == 201 and r.json()["minted_by_operator"] is True and not r.json()["decides_access"]
    r = w.gw.client.post("/v1/tokens", headers=w.h("admin-b"), json={"role": "tenant_admin", "name": "deputy"})
    assert r.status_code == 201 and r.json()["decides_access"] is True
    w.tokens["deputy-b"] = r.json()["token"]
    assert w.decide(req_b, "approve", who="deputy-b")["state"] == "active"
    # revoked, a token mints and decides nothing more, even while the principal cache still admits it
    assert w.gw.client.post(f"/v1/tokens/{second['id']}/revoke", headers=w.h("admin-b")).status_code == 200
    r = w.gw.client.post("/v1/tokens", headers=w.h("ops-b"), json={"role": "tenant_admin"})
    assert r.status_code == 403 and "revoked" in r.json()["error"]["message"]
    r = w.gw.client.post(f"/v1/tokens/{second['id']}/revoke", headers=w.h("deputy-b"))
    assert r.status_code == 200 and r.json()["revoked_at"]
    w.gw.app.state.principals = None


def test_token_routes_are_scoped_and_checked(w: World) -> None:
    a_ids = [t["id"] for t in w.gw.client.get("/v1/tokens", headers=w.h(TENANT_A)).json()["data"]]
    # members do not mint or revoke; another tenant's admin gets 404; operators get 403
    assert w.gw.client.post("/v1/tokens", headers=w.h(TENANT_A), json={}).status_code == 403
    assert w.gw.client.post(f"/v1/tokens/{a_ids[0]}/revoke", headers=w.h(TENANT_A)).status_code == 403
    assert w.gw.client.post(f"/v1/tokens/{a_ids[0]}/revoke", headers=w.h("admin-b")).status_code == 404
    assert w.gw.client.post("/v1/tokens", headers=w.h("sysadmin"), json={}).status_code == 403
    assert w.gw.client.post("/v1/tokens/rotate", headers=w.h("sysadmin")).status_code == 403
    for body in ({"role": "sysadmin"}, {"role": "staff"}, {"name": "x" * 101}, {"role": "member", "extra": 1}):
        assert w.gw.client.post("/v1/tokens", headers=w.h("admin-a"), json=body).status_code == 400, body
    # a member rotates its own token: same role, new secret, old one revoked
    r = w.gw.client.post("/v1/tokens/rotate", headers=w.h(TENANT_A))
    assert r.status_code == 201 and r.json()["role"] == "member" and r.json()["token"] != w.gw.tokens[TENANT_A]
    forget_cached_tokens(w)
    assert w.gw.client.get("/v1/tokens", headers=w.h(TENANT_A)).status_code == 401
    w.gw.tokens[TENANT_A] = r.json()["token"]
    assert w.gw.client.get("/v1/tokens", headers=w.h(TENANT_A)).status_code == 200
