"""`finetune staff|access|audit` against the gateway app: request, approve, read, audit, revoke."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from gateway.cli import main
from gateway.config import get_settings
from gateway.models import Role
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, cli_over
from tests.service.test_staff_access import World, audit_key, world  # noqa: F401 - the fixtures

pytestmark = pytest.mark.service


@pytest.fixture
def finetune(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> Any:
    return cli_over(gw, monkeypatch)


def test_request_approve_read_audit_revoke(world: World, finetune: Any) -> None:  # noqa: F811
    w = world
    staff = w.token("staff", Role.STAFF)
    code, out = finetune(staff, "staff", "request", "--tenant", TENANT_A, "--resource", f"job:{w.job}",
                         "--reason", "NaN loss, ticket 7", "--duration", "2h", "--json")
    assert code == 0, out
    req = json.loads(out)["id"]
    code, out = finetune(w.tokens["admin-a"], "access", "list")
    assert code == 0 and req in out and "pending" in out and "NaN loss" in out
    code, out = finetune(w.gw.tokens[TENANT_A], "access", "approve", req)
    assert code == 1 and "403" in out, "members cannot approve"
    code, out = finetune(w.tokens["admin-b"], "access", "approve", req)
    assert code == 1 and "404" in out, "another tenant's admin cannot see it"
    code, out = finetune(w.tokens["admin-a"], "access", "approve", req)
    assert code == 0 and "active" in out, out
    code, out = finetune(staff, "staff", "list")
    assert code == 0 and req in out and "active" in out
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/events", headers=w.h("staff")).status_code == 200
    code, out = finetune(w.gw.tokens[TENANT_A], "audit", "list")
    assert code == 0 and "read.job_events" in out and "access.approve" in out and "allowed" in out
    code, out = finetune(w.gw.tokens[TENANT_B], "audit", "list", "--json")
    assert code == 0 and {e["action"] for e in json.loads(out)["data"]} <= {"token.create", "token.revoke"}
    code, out = finetune(w.tokens["admin-a"], "access", "revoke", req)
    assert code == 0 and "revoked" in out
    assert w.gw.client.get(f"/v1/staff/jobs/{w.job}/events", headers=w.h("staff")).status_code == 403
    code, out = finetune(staff, "files", "list")
    assert code == 1 and "403" in out, "tenant commands refuse staff tokens"


def test_tokens_commands_rotate_saves_the_new_token(world: World, finetune: Any, tmp_path: Any,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`finetune tokens create|list|revoke|rotate`; rotate rewrites `finetune login`'s credentials."""
    w = world
    code, out = finetune(w.tokens["admin-a"], "tokens", "create", "--role", "member", "--name", "laptop", "--json")
    assert code == 0, out
    laptop = json.loads(out)
    assert laptop["token"].startswith("sft_") and laptop["minted_by_operator"] is False
    code, out = finetune(w.gw.tokens[TENANT_A], "tokens", "list")
    assert code == 0 and f"#{laptop['id']}" in out and "laptop" in out and laptop["token"] not in out
    creds = tmp_path / "cred.json"
    creds.write_text(json.dumps({"url": "http://testserver", "token": laptop["token"]}))
    creds.chmod(0o600)
    monkeypatch.setenv("SFT_CREDENTIALS_FILE", str(creds))
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["tokens", "rotate"], env={"SFT_API_URL": None, "SFT_API_TOKEN": None})
    finally:
        get_settings.cache_clear()
    assert res.exit_code == 0, res.output
    new = json.loads(creds.read_text())["token"]
    assert new != laptop["token"] and new in res.output and f"token #{laptop['id']} is revoked" in res.output
    assert creds.stat().st_mode & 0o777 == 0o600
    w.gw.app.state.principals = None                        # skip the token cache's grace period
    code, out = finetune(laptop["token"], "tokens", "list")
    assert code == 1 and "401" in out
    code, out = finetune(new, "tokens", "list", "--json")
    assert code == 0 and any(t["id"] == laptop["id"] and t["revoked_at"] for t in json.loads(out)["data"])
    new_id = next(t["id"] for t in json.loads(out)["data"] if t["name"] == "laptop" and not t["revoked_at"])
    code, out = finetune(w.gw.tokens[TENANT_A], "tokens", "revoke", str(new_id))
    assert code == 1 and "403" in out, "members do not revoke"
    code, out = finetune(w.tokens["admin-a"], "tokens", "revoke", str(new_id))
    assert code == 0 and "revoked" in out
