"""Reserved identities (issue 28), as root against the real cluster and the real broker: a tenant
named so that its unix user is the gateway's service user, or an account slurm-finetune did not
make, is refused by `finetune admin tenant add` before anything exists, and the broker never acts
as such an account, even when asked directly or when the registry is edited to hold it."""

from __future__ import annotations

import fcntl
import os
import pwd
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import new_id
from gateway.slurm import LocalRunner
from gateway.storage import Storage, identities, layout
from gateway.storage.broker import recv_msg, send_msg
from gateway.storage.onboarding import TenantAdmin
from tests.hostile.conftest import ATTACKER, STORAGE, uid_of
from tests.slurm.livegateway import LiveGateway

pytestmark = pytest.mark.hostile
COLLIDE = "collide"


def finetune(*args: str) -> subprocess.CompletedProcess[str]:
    """The admin CLI as root, from the installed runtime (as a sysadmin runs it)."""
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd="/", capture_output=True, text=True,
                          timeout=120)


def slurm_account_exists(name: str) -> bool:
    out = subprocess.run(["sacctmgr", "--noheader", "--parsable2", "show", "account", name, "format=Account"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return name in out.split()


def assert_nothing_made(tenant: str) -> None:
    assert not slurm_account_exists(tenant), f"a Slurm account {tenant} was created"
    assert not (STORAGE / "tenants" / tenant).exists(), "tenant storage was created"


def broker_request(tenant: str, verb: str = "read_spec", **args: Any) -> dict[str, Any]:
    """One request straight to the broker socket, as root (an allowed peer), bypassing the gateway."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(30)
        s.connect(str(Settings().broker_socket))
        send_msg(s, {"tenant": tenant, "storage_root": str(STORAGE), "verb": verb, "args": args})
        header, fds, _ = recv_msg(s)
        for fd in fds:
            os.close(fd)
        return header
    finally:
        s.close()


def _drop_registry_line(name: str) -> None:
    """Remove ``name``'s line again, under the lock ``identities.record`` takes."""
    reg = identities.TENANT_USERS
    dfd = os.open(reg.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        entries = identities.read()
        entries.pop(name, None)
        tmp = reg.with_name(f".{reg.name}.test.tmp")
        tmp.write_text(identities.render(entries.values()))
        os.chmod(tmp, 0o644)
        os.replace(tmp, reg)
    finally:
        os.close(dfd)


@pytest.fixture
def collide_user() -> Iterator[pwd.struct_passwd]:
    """An account the project did not make, named as tenant ``collide``'s user would be."""
    user = f"sft-{COLLIDE}"
    subprocess.run(["userdel", user], capture_output=True, check=False)
    subprocess.run(["useradd", "--system", user], check=True, capture_output=True)
    yield pwd.getpwnam(user)
    subprocess.run(["userdel", user], capture_output=True, check=False)
    subprocess.run(["groupdel", user], capture_output=True, check=False)


def test_tenant_add_gateway_is_refused_and_makes_nothing(gw: LiveGateway) -> None:
    res = finetune("admin", "tenant", "add", "gateway", "--qos", "ft-small")
    assert res.returncode != 0, res.stdout
    assert "sft-gateway" in res.stderr and "service user" in res.stderr and "another tenant name" in res.stderr
    assert "Traceback" not in res.stderr
    assert_nothing_made("gateway")
    assert "sft-gateway" not in identities.read()


def test_tenant_add_refuses_an_existing_account_it_did_not_make(gw: LiveGateway,
                                                                collide_user: pwd.struct_passwd) -> None:
    res = finetune("admin", "tenant", "add", COLLIDE, "--qos", "ft-small")
    assert res.returncode != 0, res.stdout
    assert f"sft-{COLLIDE}" in res.stderr and "did not make it" in res.stderr and "never adopts" in res.stderr
    assert "Traceback" not in res.stderr
    assert_nothing_made(COLLIDE)
    assert f"sft-{COLLIDE}" not in identities.read()
    # and the broker does not act as it either (the gateway would ask, since the account exists)
    reply = broker_request(COLLIDE)
    assert reply["ok"] is False and reply["code"] == "forbidden" and "is not in" in reply["message"]


def test_the_broker_refuses_the_service_user_even_when_recorded(gw: LiveGateway) -> None:
    reply = broker_request("gateway", "sweep", job_ids=[])
    assert reply == {"ok": False, "code": "forbidden", "message": reply["message"]}
    assert "sft-gateway" in reply["message"] and "service identity" in reply["message"]
    # someone edits the registry so that the name maps: the service user's uid is still refused
    pw = pwd.getpwnam("sft-gateway")
    identities.record(identities.Entry("sft-gateway", pw.pw_uid, pw.pw_gid))
    try:
        reply = broker_request("gateway", "upload_begin")
        assert reply["code"] == "forbidden" and "service identity" in reply["message"]
        with pytest.raises(ServiceError, match="service identity"):      # the gateway's own path
            Storage(STORAGE, Settings().broker_socket, "sft-gateway").tenant("gateway").read_spec(
                "ftjob-" + "0" * 24)
    finally:
        _drop_registry_line("sft-gateway")
    assert not (STORAGE / "tenants" / "gateway").exists()


def test_onboarded_tenants_are_recorded_and_served(gw: LiveGateway) -> None:
    st = identities.TENANT_USERS.stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644
    pw = pwd.getpwnam(f"sft-{ATTACKER}")
    assert identities.read()[pw.pw_name] == identities.Entry(pw.pw_name, uid_of(pw.pw_name), pw.pw_gid)
    reply = broker_request(ATTACKER, "read_spec", job_id="ftjob-" + "0" * 24)
    assert reply["ok"] is True and reply["result"] == {"found": False}
    notices: list[str] = []                                  # onboarding again: idempotent, no notice
    t = TenantAdmin(LocalRunner(), storage_root=STORAGE).add_tenant(ATTACKER, shares=5, qos=["ft-small", "ft-standard"],
                                                              notify=notices.append)
    assert t.uid == pw.pw_uid and t.storage_ok and notices == []


def test_a_nested_bracket_checkpoint_header_is_skipped_through_the_broker(gw: LiveGateway) -> None:
    """The tenant writes a checkpoint whose safetensors header is 200k nested ``[``: the broker's
    publication skips that checkpoint (as any unreadable one) and publishes the rest."""
    from safetensors.torch import save

    from tests.hostile.test_hostile_tenant import _forged_staging, _plant

    jid = new_id("ftjob")
    _forged_staging(jid)
    deep = b"[" * 200_000
    _plant(f"jobs/{jid}/checkpoints/step-3/COMPLETE", b"")
    _plant(f"jobs/{jid}/checkpoints/step-3/adapter.safetensors", len(deep).to_bytes(8, "little") + deep + b"\0" * 16)
    _plant(f"jobs/{jid}/checkpoints/step-6/COMPLETE", b"")
    _plant(f"jobs/{jid}/checkpoints/step-6/adapter.safetensors", save({"x.lora_A.default.weight": torch.ones(2, 2)}))
    store = Storage(STORAGE, Settings().broker_socket, "sft-gateway").tenant(ATTACKER)
    built = store.publish_build(jid, 0, None, [3, 6])
    try:
        assert built["checkpoints"] == [6], built
        assert "nests deeper" in built["skipped_checkpoints"]["3"]
        assert "checkpoint-step-6.tar" in built["results"]
    finally:
        store.remove([(layout.ARTIFACTS, built["name"]), layout.job(jid)])
