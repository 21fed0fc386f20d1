"""PrivateData=jobs,usage,users,accounts on the real dev cluster.

Two tenants each run a job. Tenant B, as its own unix user, sees none of tenant A's jobs
(squeue, scontrol, sacct), usage (sshare) or associations (sacctmgr), and cannot cancel
A's job. The gateway's service user (a Slurm Operator, made one by ``finetune dev-cluster
up`` through ``Admin.ensure_operator``) sees both jobs, all usage, and cancels and requeues
any tenant's job, both with the plain commands and through the gateway's own SlurmClient.
"""

from __future__ import annotations

import pwd
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence

import pytest

from gateway.slurm import LocalRunner, SlurmClient
from gateway.slurm.records import Owner
from gateway.slurm.runner import CommandResult
from gateway.storage.layout import unix_user_for
from gateway.storage.onboarding import TenantAdmin
from tests.slurm.conftest import submit, wait_for

pytestmark = pytest.mark.slurm
GATEWAY = "sft-gateway"
# Tenants of their own: the shared t-alpha/t-bravo carry the usage test_fairshare compares.
TENANT_A, TENANT_B = "t-priv-a", "t-priv-b"
PRIVATE = {"jobs", "usage", "users", "accounts"}


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True,
                          timeout=60, check=False)


def out_of(user: str, *argv: str) -> str:
    res = as_user(user, *argv)
    assert res.returncode == 0, (argv, res.stderr)
    return res.stdout


class AsUser:
    """A Runner that runs every command as ``user`` (``runuser``): the gateway as its service user."""

    def __init__(self, user: str):
        self.user, self.inner = user, LocalRunner()

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, input: str | None = None,
            env: Mapping[str, str] | None = None) -> CommandResult:
        return self.inner.run(["runuser", "-u", self.user, "--", *argv], timeout=timeout, input=input, env=env)


def _private_data() -> set[str]:
    out = LocalRunner().run(["scontrol", "show", "config"], timeout=30).check().stdout
    line = next((x for x in out.splitlines() if x.startswith("PrivateData")), "")
    return {p.strip() for p in line.partition("=")[2].split(",") if p.strip()}


@pytest.fixture(scope="module")
def gateway_operator(admin: TenantAdmin) -> str:
    try:
        pwd.getpwnam(GATEWAY)
    except KeyError:
        pytest.skip(f"no unix user {GATEWAY} (scripts/bootstrap.sh creates it)")
    have = _private_data()
    assert PRIVATE <= have, f"slurmctld runs with PrivateData={sorted(have)}: run `finetune dev-cluster up`"
    admin.ensure_operator(GATEWAY)            # what `dev-cluster up` does; idempotent
    assert admin.ensure_operator(GATEWAY) is False
    assert admin.admin_level(GATEWAY) == "Operator"
    return GATEWAY


@pytest.fixture(scope="module")
def tenants(admin: TenantAdmin) -> tuple[str, str]:
    for t in (TENANT_A, TENANT_B):
        admin.add_tenant(t, shares=10, qos=["ft-small"])
    return TENANT_A, TENANT_B


@pytest.fixture
def two_jobs(client: SlurmClient, tenants: tuple[str, str], gateway_operator: str) -> Iterator[tuple[int, int]]:
    a, b = tenants
    ja, _ = submit(client, a, "sleep 300", qos="ft-small", minutes=10, gpus=1)
    jb, _ = submit(client, b, "sleep 300", qos="ft-small", minutes=10, gpus=1)
    try:
        for j in (ja, jb):
            wait_for(client, j, lambda s: s.state == "RUNNING", 60)
        deadline = time.monotonic() + 30      # slurmdbd learns of the start a little after slurmctld
        while {r.job_id_raw for r in client.accounting([ja, jb]) if r.state == "RUNNING" and r.start} != {ja, jb}:
            assert time.monotonic() < deadline, "the jobs never reached slurmdbd"
            time.sleep(0.5)
        yield ja, jb
    finally:
        for j in (ja, jb):
            LocalRunner().run(["scancel", str(j)], timeout=30)


def _squeue_ids(user: str) -> set[int]:
    return {int(x) for x in out_of(user, "squeue", "--noheader", "--all", "--states=all", "--format=%i").split()}


def _sacct_rows(user: str, *extra: str) -> list[list[str]]:
    text = out_of(user, "sacct", "--noheader", "--parsable2", "--allocations", "--starttime=now-1days",
                  "--format=JobIDRaw,User,Account", *extra)
    return [line.split("|") for line in text.splitlines() if line.strip()]


def _sshare_rows(user: str) -> list[list[str]]:
    text = out_of(user, "sshare", "--all", "--noheader", "--parsable2", "--format=Account,User,RawUsage")
    return [[f.strip() for f in line.split("|")] for line in text.splitlines() if line.strip()]


def test_tenant_sees_none_of_the_other_tenants_jobs_or_usage(tenants: tuple[str, str],
                                                              two_jobs: tuple[int, int]) -> None:
    a, b = tenants
    ja, jb = two_jobs
    user_a, user_b = unix_user_for(a), unix_user_for(b)
    # squeue / scontrol (slurmctld)
    assert jb in _squeue_ids(user_b) and ja not in _squeue_ids(user_b)
    assert out_of(user_b, "squeue", "--noheader", f"--user={user_a}").strip() == ""
    shown = as_user(user_b, "scontrol", "show", "job", str(ja))
    assert shown.returncode != 0 and user_a not in shown.stdout, shown.stdout
    # sacct (slurmdbd): all users asked for, own rows only
    rows = _sacct_rows(user_b, "--allusers")
    assert {r[1] for r in rows} == {user_b} and str(jb) in {r[0] for r in rows}
    assert not any(str(ja) == r[0] or r[2] == a for r in rows), rows
    assert _sacct_rows(user_b, f"--jobs={ja}") == []
    assert _sacct_rows(user_b, f"--accounts={a}", "--allusers") == []
    # sshare (usage): only B's own association
    share = _sshare_rows(user_b)
    assert share and all(r[0] == b for r in share), share
    assert not any(a in r or user_a in r for r in share), share
    # sacctmgr (accounts, users): A's account and user are not even listed
    assoc = out_of(user_b, "sacctmgr", "--noheader", "--parsable2", "show", "association", "format=Account,User")
    assert a not in assoc and user_a not in assoc and b in assoc, assoc
    users = out_of(user_b, "sacctmgr", "--noheader", "--parsable2", "show", "user", "format=User")
    assert users.split() == [user_b], users
    # and B cannot act on A's job
    assert as_user(user_b, "scancel", str(ja)).returncode != 0
    assert as_user(user_b, "scontrol", "requeue", str(ja)).returncode != 0


def test_gateway_service_user_sees_everything_and_cancels_and_requeues_any_job(
        client: SlurmClient, tenants: tuple[str, str], two_jobs: tuple[int, int]) -> None:
    a, b = tenants
    ja, jb = two_jobs
    assert {ja, jb} <= _squeue_ids(GATEWAY)
    rows = _sacct_rows(GATEWAY, "--allusers")
    assert {str(ja), str(jb)} <= {r[0] for r in rows}
    accounts = {r[0] for r in _sshare_rows(GATEWAY)}
    assert {a, b} <= accounts
    # the gateway's own client, as the service user: one batched read sees both tenants' jobs
    gw = SlurmClient(AsUser(GATEWAY))
    states = gw.states([ja, jb])
    assert states[ja].state == states[jb].state == "RUNNING" and states[ja].source == "squeue"
    assert {r.job_id_raw for r in gw.accounting([ja, jb])} == {ja, jb}
    assert {a, b} <= {s.account for s in gw.sshare()}
    # requeue B's job, cancel A's
    gw.requeue(jb, owner=Owner(f"sft-{b}", b))
    deadline = time.monotonic() + 60
    while not any(r.state == "REQUEUED" for r in gw.history(jb)):     # the first run, as the requeue ended it
        assert time.monotonic() < deadline, [r.state for r in gw.history(jb)]
        time.sleep(0.5)
    assert client.states([jb])[jb].active
    res = as_user(GATEWAY, "scancel", str(ja))
    assert res.returncode == 0, res.stderr
    st = wait_for(client, ja, lambda s: not s.active, 60)
    assert st.state == "CANCELLED"
