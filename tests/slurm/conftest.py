"""Fixtures for the slurm tier: the real one-host dev cluster (`finetune dev-cluster up`)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.slurm import JobScript, LocalRunner, SlurmClient
from gateway.slurm.client import JobStatus
from gateway.storage.layout import unix_user_for
from gateway.storage.onboarding import TenantAdmin

STORAGE = Path(os.environ.get("SFT_STORAGE_ROOT", "/srv/slurm-finetune"))
TENANT_A, TENANT_B = "t-alpha", "t-bravo"


def _cluster_problem() -> str | None:
    if os.geteuid() != 0:
        return "not root: the dev cluster needs root"
    if not shutil.which("sbatch"):
        return "Slurm is not installed (run `finetune dev-cluster up` as root)"
    if LocalRunner().run(["scontrol", "ping"], timeout=10).returncode != 0:
        return "slurmctld does not answer `scontrol ping` (run `finetune dev-cluster up`)"
    return None


@pytest.fixture(scope="session")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"slurm tier skipped: {problem}")


@pytest.fixture(scope="session")
def admin(cluster: None) -> TenantAdmin:
    return TenantAdmin(LocalRunner(), storage_root=STORAGE)


@pytest.fixture(scope="session")
def tenants(admin: TenantAdmin) -> tuple[str, str]:
    admin.add_tenant(TENANT_A, shares=10, qos=["ft-standard", "ft-small"])
    admin.add_tenant(TENANT_B, shares=10, qos=["ft-standard", "ft-small"])
    return TENANT_A, TENANT_B


@pytest.fixture(scope="session")
def fairshare_load(request: pytest.FixtureRequest) -> list[int] | None:
    """Tenant A's GPU jobs for test_fairshare, submitted early in the slurm tier (``_early_load``):
    Slurm folds usage into fairshare only every PriorityCalcPeriod (1 min), which then passes while
    the other tests run instead of in that test. None when test_fairshare is not in this run or
    there is no cluster (the test then submits its own)."""
    if not any(item.path.name == "test_fairshare.py" for item in request.session.items) or _cluster_problem():
        return None
    admin: TenantAdmin = request.getfixturevalue("admin")
    admin.add_tenant(TENANT_A, shares=10, qos=["ft-standard", "ft-small"])     # as `tenants` (idempotent)
    client = SlurmClient(LocalRunner())
    return [submit(client, TENANT_A, "sleep 5")[0] for _ in range(2)]


@pytest.fixture(autouse=True)
def _early_load(request: pytest.FixtureRequest) -> None:
    """Start ``fairshare_load`` with the first slurm test after test_00_devcluster (which takes the
    cluster down and up again)."""
    if request.node.path.name != "test_00_devcluster.py":
        request.getfixturevalue("fairshare_load")


@pytest.fixture
def calls() -> list[tuple[str, ...]]:
    return []


@pytest.fixture
def client(cluster: None, calls: list[tuple[str, ...]]) -> SlurmClient:
    return SlurmClient(LocalRunner(calls))


def job_dir(tenant: str) -> Path:
    """A fresh job dir in the tenant's storage, owned by the tenant user."""
    path = STORAGE / "tenants" / tenant / "jobs" / f"test-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    user = unix_user_for(tenant)
    shutil.chown(path.parent, user, user)
    shutil.chown(path, user, user)
    return path


def submit(client: SlurmClient, tenant: str, command: str, *, qos: str = "ft-standard",
           minutes: int = 5, gpus: int = 1, account: str | None = None,
           interpreter: str = "/bin/bash", requeue: bool = True, cancel_grace_s: int = 15) -> tuple[int, Path]:
    d = job_dir(tenant)
    flag = "-c"
    script = JobScript(job_name="sft-test", account=account or tenant, qos=qos, job_dir=str(d),
                       command=(interpreter, flag, command), gpus=gpus, cpus=1, mem_mb=512,
                       time_limit_min=minutes, requeue=requeue, cancel_grace_s=cancel_grace_s)
    return client.submit(script, user=unix_user_for(tenant)), d


def wait_for(client: SlurmClient, job_id: int, ok: Callable[[JobStatus], bool],
             timeout: float = 60) -> JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        st = client.states([job_id])[job_id]
        if ok(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {st.state} ({st.reason}) after {timeout}s")
        time.sleep(0.3)


def finished(st: JobStatus) -> bool:
    return not st.active


def accounting(client: SlurmClient, job_id: int, timeout: float = 20):  # type: ignore[no-untyped-def]
    """The job's sacct row once slurmdbd has the whole record (it arrives asynchronously:
    right after a short job ends, the row may still lack its QOS and name)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = client.accounting([job_id])
        if rows and rows[0].qos is not None and rows[0].end is not None:
            return rows[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct record of {job_id} incomplete after {timeout}s: {rows}")
        time.sleep(0.5)


def wait_output(path: Path, text: str, timeout: float = 30) -> None:
    """Wait until the job's output file holds ``text`` (its command really started)."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path} after {timeout}s")
        time.sleep(0.2)
