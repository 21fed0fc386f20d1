"""Cancel racing publication, 50 times per database: every job ends succeeded-with-artifact
or cancelled-with-none, never both, never neither-with-leftovers.

The staging dir is a real one, written by the real trainer (one short run)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlmodel import Session, select

from gateway.access.tokens import authenticate, create_token
from gateway.errors import Conflict
from gateway.jobs.reconciler import Reconciler
from gateway.models import DataFile, FineTuningJob, Role, Tenant
from gateway.services.jobcontrol import request_cancel
from gateway.services.tenants import ensure_tenant
from gateway.state import JobState
from gateway.storage.layout import tenant_root
from tests.service.conftest import Gateway

pytestmark = [pytest.mark.service, pytest.mark.train]
ROOT = Path(__file__).resolve().parents[2]
RUNS = 50


@pytest.fixture(scope="module")
def real_staging(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A staging dir from a real (short) trainer run, and the base model digest."""
    from trainer import catalog
    from trainer.toydata import toy_conversations

    tmp = tmp_path_factory.mktemp("trainrun")
    entry = catalog.add(catalog.make_tiny(tmp / "tiny"), "tiny-chat", tmp / "models")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in toy_conversations(60, seed=2)))
    import hashlib

    spec = {"job_id": "ftjob-race", "base_model": {"name": "tiny-chat", "digest": entry.digest,
                                                   "catalog_root": str(tmp / "models")},
            "train": {"path": str(data), "sha256": hashlib.sha256(data.read_bytes()).hexdigest()},
            "hyperparameters": {"epochs": 1, "batch_size_tokens": 512, "max_seq_len": 256,
                                "learning_rate": 2e-3},
            "job_dir": str(tmp / "job")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, "-m", "trainer", "run", str(tmp / "spec.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                                          "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp / "job" / "attempts" / "0" / "staging", entry.digest


def _give_to_tenant(storage_root: Path, tenant: str, job_dir: Path) -> None:
    """The trainer writes a job's files as the tenant's unix user (when the host has one)."""
    import os
    import pwd

    try:
        pw = pwd.getpwnam(f"sft-{tenant}")
    except KeyError:
        return
    for p in [job_dir.parent, job_dir, *job_dir.rglob("*")]:
        os.lchown(p, pw.pw_uid, pw.pw_gid)


def test_cancel_racing_publication(gw: Gateway, real_staging: tuple[Path, str]) -> None:
    staging, digest = real_staging
    engine = gw.app.state.engine
    with Session(engine) as s:
        tenant = ensure_tenant(session=s, name="svc-a")
        token, _ = create_token(session=s, role=Role.MEMBER, tenant=tenant)
        s.commit()
        principal = authenticate(session=s, token=token)
        assert principal is not None and tenant.id is not None
        ids = []
        for i in range(RUNS + 1):
            job = FineTuningJob(tenant_id=tenant.id, status=JobState.PUBLISHING.value, training_file="x",
                                model="tiny-chat", model_digest=digest, slurm_job_id=100000 + i)
            ids.append(job.id)
            s.add(job)
            jd = tenant_root(gw.settings.storage_root, "svc-a") / "jobs" / job.id / "attempts" / "0"
            jd.mkdir(parents=True)
            shutil.copytree(staging, jd / "staging")
            _give_to_tenant(gw.settings.storage_root, "svc-a", jd.parents[1])   # as the trainer leaves it
        # result files point at files.id; keep FK happy with a placeholder dataset row
        s.add(DataFile(id="x", tenant_id=tenant.id, filename="x", bytes=0, sha256="0" * 64, status="processed"))
        s.commit()
    reconciler = Reconciler(engine, gw.settings, client=None)  # type: ignore[arg-type]
    outcomes = {"published": 0, "cancel_won": 0, "cancel_409": 0}
    lock = threading.Lock()

    def publish(job_id: str, barrier: threading.Barrier) -> None:
        with Session(engine, expire_on_commit=False) as s:
            job = s.get(FineTuningJob, job_id)
            assert job is not None
            t = s.exec(select(Tenant)).first()
            assert t is not None
            barrier.wait()
            try:
                reconciler._publish(s, job, t)
                if job.status == JobState.SUCCEEDED.value:   # a refused publication is no outcome
                    with lock:
                        outcomes["published"] += 1
            except Exception:
                s.rollback()

    def cancel(job_id: str, barrier: threading.Barrier, delay: float) -> None:
        with Session(engine, expire_on_commit=False) as s:
            barrier.wait()
            time.sleep(delay)
            try:
                request_cancel(session=s, principal=principal, job_id=job_id)
                with lock:
                    outcomes["cancel_won"] += 1
            except Conflict:
                with lock:
                    outcomes["cancel_409"] += 1

    # how long one publication takes: the cancels land from its start to twice that
    t0 = time.monotonic()
    publish(ids.pop(), threading.Barrier(1))
    t_pub = time.monotonic() - t0
    outcomes["published"] = 0
    for i, job_id in enumerate(ids):
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=publish, args=(job_id, barrier)),
                   threading.Thread(target=cancel, args=(job_id, barrier, 2 * t_pub * i / RUNS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    artifacts = tenant_root(gw.settings.storage_root, "svc-a") / "artifacts"
    with Session(engine) as s:
        for job_id in ids:
            job = s.get(FineTuningJob, job_id)
            assert job is not None
            files = list(s.exec(select(DataFile).where(DataFile.job_id == job_id)))
            dirs = [p for p in artifacts.iterdir() if p.is_dir() and any(
                f.path and f.path.startswith(f"artifacts/{p.name}/") for f in files)] if artifacts.exists() else []
            if job.status == JobState.SUCCEEDED.value:
                assert len(files) == 3 and job.fine_tuned_model and len(dirs) == 1
                assert all((tenant_root(gw.settings.storage_root, "svc-a") / f.path).is_file() for f in files if f.path)
            else:
                assert job.status == JobState.CANCELLING.value, job.status
                assert files == [] and job.fine_tuned_model is None and not job.result_files
    leftovers = [p.name for p in artifacts.iterdir()] if artifacts.exists() else []
    with Session(engine) as s:
        owned = {f.path.split("/")[1] for f in s.exec(select(DataFile)) if f.path}
    assert set(leftovers) == owned, "no artifact dir without its rows, no hidden temp dir left"
    print(f"\n{RUNS} races (publication takes {t_pub * 1000:.0f} ms): {outcomes}")
    assert outcomes["published"] + outcomes["cancel_won"] == RUNS
    assert outcomes["cancel_409"] == outcomes["published"]
    assert outcomes["published"] > 0 and outcomes["cancel_won"] > 0, "both outcomes must occur"
