"""Issue 32: a tenant deleted with a receipt, on the real cluster, with a real gateway and a real job.

A random canary goes into the tenant's dataset (its text, its file name), its job's suffix and
metadata (database rows), its checkpoint and its Slurm log (written there as the tenant's unix
user, as its job could), and into what a job whose node failed to clean up would leave outside
its storage (the scrubber's scratch dir, the job's private /tmp under job_container's BasePath,
files of the tenant's uid in /tmp, /dev/shm and /var/tmp). Deletion is refused while the job
runs; the dry run changes nothing; then `finetune admin tenant delete` removes it all: the canary
is in no file under the storage root, those places, nor in the database file and its WAL; the
receipt counts what went; `admin audit verify` holds; and a tenant onboarded again under the same
name sees none of it (no files, jobs, audit entries or deletion request; the old token gets 401).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, select

from gateway.access.tokens import create_token
from gateway.models import Role, TenantDeletionRequest
from gateway.services.tenants import ensure_tenant
from gateway.slurm.jobcontainer import read_base_paths
from tests.slurm.livegateway import FAST_HP, STORAGE, LiveGateway, terminal

pytestmark = pytest.mark.slurm
TENANT = "t-delete"
USER = f"sft-{TENANT}"
FINETUNE = "/opt/slurm-finetune/venv/bin/finetune"
SCRATCH = Path("/var/lib/slurm-finetune/scratch")
TMP_DIRS = (Path("/tmp"), Path("/dev/shm"), Path("/var/tmp"))


def _admin(gw: LiveGateway, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FINETUNE, "admin", *args], env=gw.env, capture_output=True, text=True, timeout=180,
                          cwd="/")


def _as_tenant(script: str) -> None:
    subprocess.run(["runuser", "-u", USER, "--", "sh", "-c", script], check=True, capture_output=True, timeout=30)


def _dataset(path: Path, canary: str) -> Path:
    from trainer.toydata import toy_conversations

    rows = toy_conversations(16, seed=5)
    rows[3]["messages"][-1]["content"] += f" {canary}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files_holding(roots: list[Path], needle: bytes, since: float, skip: Path) -> list[str]:
    """Every regular file beneath ``roots`` changed since ``since`` (older ones cannot hold a canary
    made after it) whose bytes contain ``needle``, never following a link; ``skip``: the test's own dir."""
    hits = []
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            if Path(dirpath) == skip or Path(dirpath).is_relative_to(skip):
                dirs[:] = []
                continue
            for name in files:
                p = Path(dirpath) / name
                try:
                    st = p.lstat()
                    if not p.is_symlink() and p.is_file() and st.st_ctime >= since and needle in p.read_bytes():
                        hits.append(str(p))
                except OSError:
                    continue
    return hits


def _listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*"))


def test_a_deleted_tenant_leaves_no_trace_and_its_name_starts_afresh(
        cluster: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    t0 = time.monotonic()
    since = time.time() - 2
    canary = secrets.token_hex(16)
    work = tmp_path_factory.mktemp("tdel")
    # the retention sweeper (another part of issue 32) must not prune the planted checkpoint meanwhile
    quiet = {"SFT_SWEEP_INTERVAL_S": "0"}
    gw = LiveGateway(work, (TENANT,), **quiet)
    try:
        _run(gw, work, canary, since)
    finally:
        gw.stop()
        _admin(gw, "tenant", "delete", TENANT, "--yes")     # leave the cluster as it was
    print(f"\ntenant delete test: {time.monotonic() - t0:.1f}s")


def _run(gw: LiveGateway, work: Path, canary: str, since: float) -> None:
    old_uid = int(subprocess.run(["id", "-u", USER], capture_output=True, text=True, check=True).stdout)
    source = _dataset(work / f"data-{canary}.jsonl", canary)
    file_id = gw.upload(TENANT, source)
    source.unlink()         # the client's copy: only the gateway's should be left to find
    job = gw.create(TENANT, file_id, hp={**FAST_HP, "checkpoint_every_steps": 1}, suffix=canary[:20],
                    metadata={"note": canary})
    with Session(gw.engine) as s:
        tenant = ensure_tenant(session=s, name=TENANT)
        admin_token, _ = create_token(session=s, role=Role.TENANT_ADMIN, tenant=tenant)
        s.commit()
    asked = httpx.post(gw.url + "/v1/tenant/deletion_request", json={"reason": "project over"}, timeout=30,
                       headers={"Authorization": f"Bearer {admin_token}"})
    assert asked.status_code == 200 and asked.json()["status"] == "pending", asked.text
    member = gw.api("POST", "/v1/tenant/deletion_request", TENANT, json={})
    assert member.status_code == 403, member.text
    listed = _admin(gw, "tenant", "delete-requests", "--json")
    assert any(r["tenant"] == TENANT for r in json.loads(listed.stdout)), listed.stderr

    refused = _admin(gw, "tenant", "delete", TENANT, "--yes")
    assert refused.returncode != 0 and "cannot be deleted now" in refused.stderr, refused.stderr
    assert job["id"] in refused.stderr

    done = gw.wait(TENANT, job["id"], terminal, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    sid = int(done["slurm_job_id"])
    root = STORAGE / "tenants" / TENANT
    jobdir = root / "jobs" / job["id"]
    ckpt = sorted((jobdir / "checkpoints").iterdir())[-1]
    # what the tenant's job could have written: its checkpoint, its Slurm log
    _as_tenant(f"printf %s {canary} > {ckpt}/planted.bin && echo {canary} >> {jobdir}/slurm-{sid}.out")
    # what a job leaves when its node's scrub failed: scratch, its private /tmp, its uid's temp files
    planted = [SCRATCH / f"job-{sid}"] + [b / str(sid) for b in read_base_paths()]
    for d in planted:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.chown(d, USER, USER)
        _as_tenant(f"echo {canary} > {d}/left")
    temps = [t / f"sft-del-{canary[:8]}" for t in TMP_DIRS]
    _as_tenant(" && ".join(f"echo {canary} > {t}" for t in temps))

    before = _listing(root)
    dry = _admin(gw, "tenant", "delete", TENANT, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["refusals"] == [] and plan["database"]["tables"]["files"] >= 1
    assert {"datasets", "checkpoints", "logs"} <= set(plan["storage"]["kinds"])
    assert {p["path"] for p in plan["node_leftovers"]} >= {str(p) for p in planted + temps}
    assert _listing(root) == before and all(p.exists() for p in planted + temps), "the dry run changed something"
    assert gw.api("GET", "/v1/files", TENANT).status_code == 200

    receipt = work / "receipt.json"
    deleted = _admin(gw, "tenant", "delete", TENANT, "--yes", "--receipt", str(receipt), "--json")
    assert deleted.returncode == 0, deleted.stderr
    out = json.loads(deleted.stdout)
    print("\nreceipt:", receipt.read_text())
    assert out["sha256"] == hashlib.sha256(receipt.read_bytes()).hexdigest()
    assert receipt.stat().st_mode & 0o777 == 0o600 and receipt.stat().st_uid == 0
    assert canary not in receipt.read_text(), "the receipt names what went, never its content"
    r = out["receipt"]
    kinds = r["storage"]["kinds"]
    for kind in ("datasets", "checkpoints", "logs", "results"):
        assert kinds[kind]["files"] > 0 and kinds[kind]["bytes"] > 0 and len(kinds[kind]["sha256"]) == 64, kind
    assert r["node_leftovers"]["files"] >= len(planted) + len(temps)
    tables = r["database"]["tables"]
    assert tables["files"]["rows"] >= 1 and tables["fine_tuning_jobs"]["rows"] == 1
    assert tables["job_events"]["rows"] > 0 and tables["api_tokens"]["rows"] == 2 and tables["tenants"]["rows"] == 1
    assert r["slurm"] == {"account": TENANT, "removed": True}
    assert r["unix_user"]["removed"] and r["unix_user"]["uid"] == old_uid
    assert "no freed page or WAL frame kept" in out["database_scrub"], out["database_scrub"]

    verify = _admin(gw, "audit", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with Session(gw.engine) as s:
        req = s.exec(select(TenantDeletionRequest).where(TenantDeletionRequest.tenant == TENANT)).one()
        assert (req.status, req.receipt_sha256) == ("done", out["sha256"])

    # the scan: nowhere under the storage root, the nodes' places, the temp dirs, the database's files
    assert not root.exists()
    db = Path(gw.db_url.split("///", 1)[1])
    roots = [STORAGE, SCRATCH, *read_base_paths(), *TMP_DIRS]
    assert _files_holding(roots, canary.encode(), since, skip=work) == []
    for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        assert not f.exists() or canary.encode() not in f.read_bytes(), f"the canary survives in {f}"
    assert subprocess.run(["id", USER], capture_output=True).returncode != 0

    # the name again: a new tenant, none of the old data, the old tokens refused
    again = _admin(gw, "tenant", "add", TENANT, "--qos", "ft-small,ft-standard")
    assert again.returncode == 0, again.stderr
    assert int(subprocess.run(["id", "-u", USER], capture_output=True, text=True).stdout) != old_uid
    with Session(gw.engine) as s:
        fresh, _ = create_token(session=s, role=Role.TENANT_ADMIN, tenant=ensure_tenant(session=s, name=TENANT))
        s.commit()
    new = {"Authorization": f"Bearer {fresh}"}
    for path in ("/v1/files", "/v1/fine_tuning/jobs"):
        got = httpx.get(gw.url + path, headers=new, timeout=30)
        assert got.status_code == 200 and got.json()["data"] == [], (path, got.text)
    assert httpx.get(gw.url + "/v1/tenant/deletion_request", headers=new, timeout=30).json()["status"] == "none"
    seen = httpx.get(gw.url + "/v1/audit", headers=new, timeout=30).json()["data"]
    assert seen and all(not e["action"].startswith("tenant.delete") for e in seen), seen
    time.sleep(2.5)         # past the gateway's token cache (SFT_TOKEN_CACHE_S, 2 s)
    for old in (gw.tokens[TENANT], admin_token):
        assert httpx.get(gw.url + "/v1/files", headers={"Authorization": f"Bearer {old}"},
                         timeout=30).status_code == 401
