"""Claiming an operator-minted tenant_admin token needs the one-time code the mint wrote into the
tenant's own storage: rotation alone claims nothing; the code works once, before it expires; every
refusal is audited. Every token an operator mints is an alert in the tenant's audit log, and reads
made with an operator-minted token are audited."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gateway.models import Role
from tests.service.conftest import TENANT_A, TENANT_B
from tests.service.test_staff_access import World, audit_key, claim_code_in, portal, world  # noqa: F401 - fixtures
from tests.service.test_staff_tokens import admin_cli, audit_of, cli_mint, forget_cached_tokens

pytestmark = pytest.mark.service


@pytest.fixture
def w(world: World) -> World:  # noqa: F811 - the imported fixture
    world.clock["now"] = datetime.now(UTC)       # the admin CLI mints on the database's clock
    return world


@pytest.fixture
def finetune(w: World, monkeypatch: pytest.MonkeyPatch) -> Any:
    from tests.service.conftest import cli_over

    return cli_over(w.gw, monkeypatch)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def without_own_admin(w: World, tenant: str) -> None:
    """Revoke the tenant's own admin tokens (the sysadmin CLI): the next admin mint comes with a code."""
    for t in w.gw.client.get("/v1/tokens", headers=w.h(tenant)).json()["data"]:
        if t["decides_access"]:
            code, out = admin_cli(w, "token", "revoke", str(t["id"]))
            assert code == 0, out
    forget_cached_tokens(w)


def claim(w: World, token: str, code: str) -> Any:
    return w.gw.client.post("/v1/tokens/claim", headers=bearer(token), json={"code": code})


def staff_request(w: World) -> str:
    w.token("staff", Role.STAFF)
    return w.request("staff", f"job:{w.job}")


def test_the_code_is_delivered_to_the_tenants_storage_and_never_shown(w: World) -> None:
    without_own_admin(w, TENANT_A)
    code, text = admin_cli(w, "token", "create", "--tenant", TENANT_A, "--role", "tenant_admin")
    assert code == 0, text
    minted = cli_mint(w, "tenant_admin", name="second")       # still no own admin: a code of its own
    for path in (minted["claim_file"], text.split("storage: ")[1].split()[0]):
        f = Path(path)
        assert f.parent == w.gw.settings.storage_root / "tenants" / TENANT_A and f.name.startswith("CLAIM-CODE-")
        st = f.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        if os.geteuid() == 0:            # written by the broker as the tenant's unix user
            assert st.st_uid == pwd.getpwnam(f"sft-{TENANT_A}").pw_uid
        secret_code = claim_code_in(path)
        assert secret_code not in text and secret_code not in json.dumps(minted)
    assert "not shown here" in text and "finetune tokens claim --code-file" in text
    assert Path(minted["claim_file"]).name == f"CLAIM-CODE-{minted['id']}"
    # the tenant's audit says where the code went, never the code
    entry = next(e for e in audit_of(w, TENANT_A) if e["resource"] == f"token:{minted['id']}")
    assert entry["outcome"] == "alert" and f"CLAIM-CODE-{minted['id']}" in entry["reason"]
    assert claim_code_in(minted["claim_file"]) not in json.dumps(audit_of(w, TENANT_A))
    listed = {t["id"]: t for t in w.gw.client.get("/v1/tokens", headers=w.h(TENANT_A)).json()["data"]}
    assert listed[minted["id"]]["claim_expires_at"] and not listed[minted["id"]]["decides_access"]


def test_rotation_claims_nothing_the_code_claims_once(w: World) -> None:
    without_own_admin(w, TENANT_A)
    minted = cli_mint(w, "tenant_admin")
    code = claim_code_in(minted["claim_file"])
    req = staff_request(w)
    # the attack: whoever minted it rotates it, and gets an operator-minted token still
    r = w.gw.client.post("/v1/tokens/rotate", headers=bearer(minted["token"]))
    assert r.status_code == 201, r.text
    rotated = r.json()
    assert rotated["minted_by_operator"] is True and rotated["decides_access"] is False
    r = w.gw.client.post(f"/v1/access-requests/{req}/approve", headers=bearer(rotated["token"]))
    assert r.status_code == 403 and "finetune tokens claim" in r.json()["error"]["message"]
    # wrong codes: refused, audited, nothing changes
    for wrong in ("sftclaim_" + secrets.token_urlsafe(36), "not-a-code", code[:-2]):
        r = claim(w, rotated["token"], wrong)
        assert r.status_code == 403 and r.json()["error"]["code"] == "claim_refused", r.text
    denied = [e for e in audit_of(w, TENANT_A) if e["action"] == "token.claim" and e["outcome"] == "denied"]
    assert len(denied) == 3 and all(e["resource"] == f"token:{rotated['id']}" for e in denied)
    # the code (it moved to the rotated secret) claims it: a new secret, the tenant's own
    r = claim(w, rotated["token"], code)
    assert r.status_code == 201, r.text
    own = r.json()
    assert own["minted_by_operator"] is False and own["decides_access"] is True and own["role"] == "tenant_admin"
    assert own["minted_by"] == f"claim of token #{rotated['id']} by its holder"
    forget_cached_tokens(w)
    assert w.gw.client.get("/v1/tokens", headers=bearer(rotated["token"])).status_code == 401
    r = w.gw.client.post(f"/v1/access-requests/{req}/approve", headers=bearer(own["token"]))
    assert r.status_code == 200 and r.json()["state"] == "active"
    # once: the same code again, from any token of the tenant, is refused
    r = claim(w, own["token"], code)
    assert r.status_code == 409 and r.json()["error"]["code"] == "claim_used", r.text
    assert claim(w, rotated["token"], code).status_code == 401
    entries = audit_of(w, TENANT_A)
    assert any(e["action"] == "token.create" and "claimed with the one-time code" in e["reason"] for e in entries)
    assert any(e["action"] == "token.claim" and "already used" in e["reason"] for e in entries)


def test_a_code_claims_only_its_own_token_of_its_own_tenant_before_it_expires(w: World) -> None:
    without_own_admin(w, TENANT_A)
    without_own_admin(w, TENANT_B)
    a1, a2 = cli_mint(w, "tenant_admin", name="a1"), cli_mint(w, "tenant_admin", name="a2")
    b1 = cli_mint(w, "tenant_admin", tenant=TENANT_B, name="b1")
    code_a1, code_b1 = claim_code_in(a1["claim_file"]), claim_code_in(b1["claim_file"])
    r = claim(w, a2["token"], code_a1)
    assert r.status_code == 403 and f"token #{a1['id']}'s" in r.json()["error"]["message"]
    r = claim(w, a1["token"], code_b1)
    assert r.status_code == 403 and "not a claim code of your tenant" in r.json()["error"]["message"]
    r = claim(w, w.gw.tokens[TENANT_A], code_a1)                     # a member token
    assert r.status_code == 403
    # seven days later the code is dead (the app's clock started a moment before the mints)
    w.advance(days=7, minutes=1)
    r = claim(w, a1["token"], code_a1)
    assert r.status_code == 403 and r.json()["error"]["code"] == "claim_expired", r.text
    assert any(e["action"] == "token.claim" and "expired" in e["reason"] for e in audit_of(w, TENANT_A))
    w.advance(days=-7, minutes=-1)
    assert claim(w, b1["token"], code_b1).status_code == 201
    assert claim(w, a1["token"], code_a1).status_code == 201


def test_operator_mints_are_alerts_in_the_tenants_audit(w: World, finetune: Any) -> None:
    minted = cli_mint(w, "member", name="ops-member")
    entry = next(e for e in audit_of(w, TENANT_A) if e["resource"] == f"token:{minted['id']}")
    assert (entry["action"], entry["outcome"], entry["actor_role"]) == ("token.create", "alert", "sysadmin")
    assert "an operator may hold its secret" in entry["reason"] and "Revoke it" in entry["reason"]
    code, out = finetune(w.gw.tokens[TENANT_A], "audit", "list")
    assert code == 0 and "alert" in out and f"token:{minted['id']}" in out, out
    # the tenant's own admin minting is no alert; another tenant sees nothing of it
    r = w.gw.client.post("/v1/tokens", headers=w.h("admin-a"), json={"role": "member"})
    own = next(e for e in audit_of(w, TENANT_A) if e["resource"] == f"token:{r.json()['id']}")
    assert own["outcome"] == "allowed"
    assert not any(e["resource"] == f"token:{minted['id']}" for e in audit_of(w, TENANT_B))


ROUTES = ["/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/fine_tuning/jobs",
          "/v1/fine_tuning/jobs/{job_id}", "/v1/fine_tuning/jobs/{job_id}/events"]


def reads(w: World) -> list[str]:
    return [r.replace("{file_id}", w.file).replace("{job_id}", w.job) for r in ROUTES]


def test_reads_with_operator_minted_tokens_are_audited(w: World) -> None:
    minted = cli_mint(w, "member", name="ops-member")
    ops = bearer(minted["token"])
    before = w.audit_count(minted["token"])
    for url, route in zip(reads(w), ROUTES, strict=True):
        assert w.gw.client.get(url, headers=ops).status_code == 200, url
        entry = w.last_audit(minted["token"])
        assert entry.tenant == TENANT_A and entry.action.startswith("read.") and f"GET {route} " in entry.reason
    assert w.audit_count(minted["token"]) == before + len(reads(w))
    for url in reads(w):      # read again within the window: the log already shows these reads
        assert w.gw.client.get(url, headers=ops).status_code == 200
    assert w.audit_count(minted["token"]) == before + len(reads(w))
    by_route = {e["reason"].split(" with ")[0]: e for e in audit_of(w, TENANT_A) if e["action"].startswith("read.")}
    assert by_route["GET /v1/files/{file_id}/content"]["resource"] == f"file:{w.file}"
    assert by_route["GET /v1/fine_tuning/jobs/{job_id}/events"]["action"] == "read.fine_tuning.jobs.events"
    assert by_route["GET /v1/fine_tuning/jobs/{job_id}/events"]["resource"] == f"job:{w.job}"
    # the token and audit views are not the tenant's data; an operator-minted admin's reads count too
    for url in ("/v1/tokens", "/v1/audit", "/v1/access-requests"):
        assert w.gw.client.get(url, headers=ops).status_code == 200
    assert w.audit_count(minted["token"]) == before + len(reads(w))
    w.token("ops-admin", Role.TENANT_ADMIN, TENANT_A, claim=False)
    n = w.audit_count(w.tokens["ops-admin"])
    assert w.gw.client.get(f"/v1/files/{w.file}/content", headers=w.h("ops-admin")).status_code == 200
    assert w.audit_count(w.tokens["ops-admin"]) == n + 1
    # signed into the portal with it: the same
    page = portal(w.gw, minted["token"])
    n = w.audit_count(minted["token"])
    assert page.get(f"/portal/files/{w.file}/download").status_code == 200
    assert page.get("/portal/access").status_code == 200
    entry = w.last_audit(minted["token"])
    assert w.audit_count(minted["token"]) == n + 1 and entry.action == "read.portal.files.download"
    assert entry.resource == f"file:{w.file}"
    # the tenant's own tokens read unaudited
    r = w.gw.client.post("/v1/tokens", headers=w.h("admin-a"), json={"role": "member"})
    own = r.json()["token"]
    for url in reads(w):
        assert w.gw.client.get(url, headers=bearer(own)).status_code == 200
    assert w.audit_count(own) == 0 and w.audit_count(w.tokens["admin-a"]) > 0


def test_finetune_tokens_claim_reads_the_code_file(w: World, finetune: Any, tmp_path: Path) -> None:
    without_own_admin(w, TENANT_A)
    minted = cli_mint(w, "tenant_admin")
    code, out = finetune(minted["token"], "tokens", "claim")
    assert code != 0 and "--code-file" in out
    empty = tmp_path / "empty"
    empty.write_text("nothing here\n")
    code, out = finetune(minted["token"], "tokens", "claim", "--code-file", str(empty))
    assert code != 0 and "holds 0 claim codes" in out
    code, out = finetune(minted["token"], "tokens", "claim", "sftclaim_" + "x" * 48)
    assert code == 1 and "403" in out
    code, out = finetune(minted["token"], "tokens", "claim", "--code-file", minted["claim_file"], "--json")
    assert code == 0, out
    obj = json.loads(out)
    assert obj["decides_access"] is True and obj["minted_by_operator"] is False
    assert claim_code_in(minted["claim_file"]) not in out
    code, out = finetune(obj["token"], "tokens", "claim", "--code-file", minted["claim_file"])
    assert code == 1 and "409" in out and "already used" in out
    code, out = finetune(obj["token"], "tokens", "list")
    assert code == 0 and f"#{obj['id']}" in out and "decides access" in out


def test_the_code_expires_after_seven_days(w: World) -> None:
    without_own_admin(w, TENANT_A)
    minted = cli_mint(w, "tenant_admin")
    expires = datetime.fromisoformat(minted["claim_expires_at"])
    assert timedelta(days=6, hours=23) < expires - datetime.now(UTC) <= timedelta(days=7)
