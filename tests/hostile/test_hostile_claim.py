"""The claim code of an operator-minted tenant_admin token, on the real gateway, broker and cluster:
the mint writes it into the tenant's storage as the tenant's unix user (0600), so the tenant reads it
and claims the token; the operator who minted it (its CLI output, any API route, the gateway's own
service user) and another tenant's unix user cannot. Root can read it: out of scope (SECURITY.md)."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys

import httpx
import pytest
from sqlmodel import Session

from gateway.access.tokens import create_token
from gateway.models import Role
from tests.hostile.conftest import ATTACKER, STORAGE, VICTIM, as_tenant, uid_of
from tests.slurm.livegateway import LiveGateway

pytestmark = pytest.mark.hostile
CODE = re.compile(r"sftclaim_[A-Za-z0-9_-]+")


def _admin_cli(gw: LiveGateway, *args: str) -> str:
    """`finetune admin ...` as root on the gateway host, on the live gateway's database."""
    res = subprocess.run([sys.executable, "-m", "gateway", "admin", *args], env=gw.env, cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr + res.stdout
    return res.stdout


def _cannot_read(user: str, path: str) -> None:
    res = subprocess.run(["runuser", "-u", user, "--", "cat", path], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "Permission denied" in res.stderr and not CODE.search(res.stdout), res


def _post(gw: LiveGateway, path: str, token: str, **kw: object) -> httpx.Response:
    return httpx.post(gw.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=60, **kw)  # type: ignore[arg-type]


def test_only_the_tenants_unix_user_reads_the_claim_code(gw: LiveGateway) -> None:
    out = _admin_cli(gw, "token", "create", "--tenant", VICTIM, "--role", "tenant_admin", "--json")
    minted = json.loads(out)
    path = minted["claim_file"]
    assert path == str(STORAGE / "tenants" / VICTIM / f"CLAIM-CODE-{minted['id']}"), minted
    st = (STORAGE / "tenants" / VICTIM / f"CLAIM-CODE-{minted['id']}").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == uid_of(f"sft-{VICTIM}")
    assert not CODE.search(out), "the operator's CLI never prints the code"
    # the tenant's unix user reads it
    found = CODE.findall(as_tenant(VICTIM, f"cat CLAIM-CODE-{minted['id']}").stdout)
    assert len(found) == 1
    code = found[0]
    # the gateway's service user (what a staff or sysadmin token acts through) and another tenant cannot
    _cannot_read("sft-gateway", path)
    _cannot_read(f"sft-{ATTACKER}", path)
    # the operator holding the minted secret: rotation claims nothing, and no route serves the file
    r = _post(gw, "/v1/tokens/rotate", minted["token"])
    assert r.status_code == 201 and r.json()["minted_by_operator"] is True, r.text
    rotated = r.json()["token"]
    with Session(gw.engine) as s:
        staff, _ = create_token(session=s, role=Role.STAFF, tenant=None, name="hostile-claim")
        s.commit()
    for token in (staff, rotated):
        r = httpx.get(gw.url + "/v1/files", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert "CLAIM-CODE" not in r.text and not CODE.search(r.text)
    assert _post(gw, "/v1/tokens/claim", staff, json={"code": code}).status_code == 403
    assert _post(gw, "/v1/tokens/claim", rotated, json={"code": "sftclaim_" + "A" * 48}).status_code == 403
    # the tenant, with the code it read, claims the token once
    r = _post(gw, "/v1/tokens/claim", rotated, json={"code": code})
    assert r.status_code == 201 and r.json()["decides_access"] is True, r.text
    assert _post(gw, "/v1/tokens/claim", r.json()["token"], json={"code": code}).status_code == 409
    audit = httpx.get(gw.url + "/v1/audit?limit=1000", headers=gw.h(VICTIM), timeout=60).json()["data"]
    assert any(e["action"] == "token.create" and e["outcome"] == "alert"
               and e["resource"] == f"token:{minted['id']}" for e in audit)
    assert code not in json.dumps(audit)
