"""Issue 32: a tenant's storage quota, enforced by the kernel, met by an upload and by a job.

The dev cluster puts ``/srv/slurm-finetune/tenants`` on a btrfs image with quotas on, and each
tenant root is a subvolume; ``finetune admin tenant quota`` sets its qgroup's limit. Nothing here
is simulated: the upload streams through the real gateway and broker until the kernel answers
EDQUOT, and the checkpoint that passes the limit is written by the real trainer in a Slurm job.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.slurm import LocalRunner
from gateway.storage import layout, quota
from gateway.storage.onboarding import TenantAdmin
from tests.service.test_portal_session import sign_in
from tests.slurm.livegateway import FAST_HP, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
A, B = "t-quota-a", "t-quota-b"
FINETUNE = "/opt/slurm-finetune/venv/bin/finetune"
KiB = 1 << 10
HP = {**FAST_HP, "checkpoint_every_steps": 1, "keep_checkpoints": 1}


def _quota_on() -> bool:
    fd = os.open(layout.tenants_dir(STORAGE), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return quota.enabled(fd)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    if not _quota_on():
        pytest.skip("the tenants directory is not btrfs with quotas on (finetune dev-cluster up says why)")
    g = LiveGateway(tmp_path_factory.mktemp("quota"), (A, B))
    yield g
    g.stop()
    for t in (A, B):
        TenantAdmin(LocalRunner(), storage_root=STORAGE).set_quota(t, None)


def _admin() -> TenantAdmin:
    return TenantAdmin(LocalRunner(), storage_root=STORAGE)


def _used(tenant: str) -> int:
    used = _admin().storage_usage(tenant).used_bytes
    assert used is not None
    return used


def _set_quota(tenant: str, limit: int | None) -> str:
    """The sysadmin's command, as a sysadmin runs it (root), against the test gateway's database."""
    env = {**os.environ, "SFT_DATABASE_URL": GW_DB[0], "SFT_AUDIT_KEY_FILE": GW_DB[1]}
    r = subprocess.run([FINETUNE, "admin", "tenant", "quota", tenant, "--space", str(limit or "none")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


GW_DB: list[str] = []


def _upload(gw: LiveGateway, tenant: str, path: Path) -> tuple[int, dict[str, object]]:
    with open(path, "rb") as f:
        r = gw.api("POST", "/v1/files", tenant, data={"purpose": "fine-tune"}, files={"file": (path.name, f)})
    return r.status_code, r.json()


def _leftovers(tenant: str) -> list[str]:
    d = layout.tenant_root(STORAGE, tenant) / layout.DATASETS
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".")) if d.is_dir() else []


def test_an_upload_past_the_quota_is_refused_with_507_and_leaves_nothing(gw: LiveGateway, tmp_path: Path) -> None:
    GW_DB[:] = [gw.db_url, gw.env["SFT_AUDIT_KEY_FILE"]]
    big = chat_file(tmp_path / "big.jsonl", 4000, seed=3)          # about 1 MB
    assert big.stat().st_size > 600 * KiB
    files_before = gw.api("GET", "/v1/files", A).json()["data"]
    used = _used(A)
    out = _set_quota(A, used + 256 * KiB)
    assert "enforced by btrfs qgroup" in out, out

    status, body = _upload(gw, A, big)
    print(f"\nquota {quota.human(used + 256 * KiB)} (used {quota.human(used)}): a {quota.human(big.stat().st_size)} "
          f"upload answered {status}: {body}")
    assert status == 507, body
    err = body["error"]
    assert isinstance(err, dict) and err["code"] == "storage_quota_exceeded"
    assert "storage quota exceeded" in str(err["message"]) and "Traceback" not in str(err["message"])
    assert _leftovers(A) == [], "no temp file of the refused upload stays"
    assert gw.api("GET", "/v1/files", A).json()["data"] == files_before
    assert _used(A) <= used + 64 * KiB, "the refused bytes were freed"

    usage = gw.api("GET", "/v1/usage", A).json()
    assert usage["storage"]["limit_bytes"] == used + 256 * KiB and usage["storage"]["enforced_by"] == "btrfs qgroup"
    assert 0 < usage["storage"]["used_bytes"] <= used + 64 * KiB and usage["storage"]["percent"] > 0

    # the portal's datasets page shows the same figures, with a meter
    with httpx.Client(base_url=gw.url, timeout=30) as web:
        sign_in(web, gw.tokens[A])
        page = web.get("/portal/datasets").text
    assert 'id="storage-meter"' in page and f'max="{used + 256 * KiB}"' in page
    assert f"used of {quota.human(used + 256 * KiB)}" in page

    # the other tenant, meanwhile: the same bytes are stored for it, and its usage is its own
    status_b, body_b = _upload(gw, B, big)
    assert status_b == 200 and body_b["status"] == "processed", body_b
    assert gw.api("GET", "/v1/usage", B).json()["storage"]["limit_bytes"] is None


def _checkpoints(tenant: str, job_id: str) -> Path:
    return layout.tenant_root(STORAGE, tenant).joinpath(*layout.job(job_id)) / "checkpoints"


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _first_checkpoint(tenant: str, job_id: str, timeout: float = 180) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = _checkpoints(tenant, job_id)
        done = sorted(p for p in d.glob("step-*") if (p / "COMPLETE").is_file()) if d.is_dir() else []
        if done:
            return done[0]
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} wrote no checkpoint in {timeout}s")


def test_a_job_that_fills_the_quota_while_checkpointing_fails_as_a_user_error(gw: LiveGateway,
                                                                                tmp_path: Path) -> None:
    GW_DB[:] = [gw.db_url, gw.env["SFT_AUDIT_KEY_FILE"]]
    _set_quota(A, None)
    data = chat_file(tmp_path / "train.jsonl", 120, seed=5)
    fa, fb = gw.upload(A, data), gw.upload(B, data)
    # tenant B's job, the same work, runs beside A's: its first checkpoint gives the size of one
    jb = gw.create(B, fb, hp=HP, suffix="quota-b")
    size = _dir_bytes(_first_checkpoint(B, jb["id"]))
    limit = _used(A) + size * 3 // 2       # one checkpoint fits; writing the next beside it does not
    _set_quota(A, limit)
    ja = gw.create(A, fa, hp=HP, suffix="quota-a")
    a = gw.wait(A, ja["id"], terminal, timeout=300)
    b = gw.wait(B, jb["id"], terminal, timeout=300)
    ckpts = _checkpoints(A, ja["id"])
    names = sorted(p.name for p in ckpts.iterdir())
    print(f"\ncheckpoint {quota.human(size)}, quota {quota.human(limit)}: A {a['status']} {a['error']}, "
          f"A's checkpoints {names}; B {b['status']}")
    assert b["status"] == "succeeded", b["error"]
    assert a["status"] == "failed" and a["error"]["code"] == "user_error", a["error"]
    assert "storage quota exceeded: delete files or ask for more" in a["error"]["message"], a["error"]
    # the last complete checkpoint is intact and loadable; nothing half-written is left beside it
    assert names and all(n.startswith("step-") for n in names), names
    last = ckpts / names[-1]
    assert (last / "COMPLETE").is_file()
    from safetensors.torch import load_file

    adapter = load_file(str(last / "adapter.safetensors"))
    assert adapter and all(t.numel() > 0 for t in adapter.values())
    progress = json.loads((last / "progress.json").read_text())
    assert f"step {progress['step']}" in a["error"]["message"]
