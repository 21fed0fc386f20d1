"""Reconciler decisions against the argv-level FakeSlurm and a real SQLite file:
batching, a failed query changing nothing, recovery of interrupted submissions."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from gateway.config import Settings
from gateway.db import make_engine, migrate
from gateway.jobstate import JobState
from gateway.models import DataFile, FineTuningJob, Tenant, utcnow
from gateway.reconciler import Reconciler
from gateway.slurm import JobScript, SlurmClient, SlurmCommandError
from gateway.slurm.fake import FakeSlurm
from gateway.storage.layout import tenant_root


@pytest.fixture
def env(tmp_path: Path) -> tuple[Any, Settings, FakeSlurm, SlurmClient]:
    settings = Settings(storage_root=tmp_path / "s", database_url=f"sqlite:///{tmp_path / 'g.db'}",
                        submission_grace_s=0)
    engine = make_engine(settings.database_url)
    migrate(engine)
    fake = FakeSlurm(accounts=("acme",))
    with Session(engine) as s:
        s.add(Tenant(id=1, name="acme", unix_user="sft-acme"))
        s.commit()
        s.add(DataFile(id="file-1", tenant_id=1, filename="t", bytes=1, sha256="0" * 64, status="processed"))
        s.commit()
    return engine, settings, fake, SlurmClient(fake)


def _job(engine: Any, **kw: Any) -> str:
    with Session(engine) as s:
        job = FineTuningJob(tenant_id=1, training_file="file-1", model="m",
                            created_at=utcnow() - timedelta(minutes=5), **kw)
        s.add(job)
        s.commit()
        return job.id


def _status(engine: Any, job_id: str) -> FineTuningJob:
    with Session(engine) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        return job


def test_one_batched_query_for_many_jobs(env: Any) -> None:
    engine, settings, fake, client = env
    ids = []
    for _ in range(30):
        sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)))
        fake.start(sid)
        ids.append(_job(engine, status="queued", slurm_job_id=sid))
    fake.calls.clear()
    stats = Reconciler(engine, settings, client).cycle()
    assert stats.jobs == 30 and fake.count("squeue") == 1 and fake.count("sacct") == 0
    assert {_status(engine, j).status for j in ids} == {"running"}


def test_failed_slurm_query_changes_nothing(env: Any) -> None:
    engine, settings, fake, client = env
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)))
    jid = _job(engine, status="queued", slurm_job_id=sid)
    fake.start(sid)
    fake.fail_next["squeue"] = (1, "slurm_load_jobs error: Unable to contact slurm controller")
    with pytest.raises(SlurmCommandError):
        Reconciler(engine, settings, client).cycle()
    assert _status(engine, jid).status == "queued" and _status(engine, jid).version == 0


def test_job_missing_from_slurm_is_not_failed(env: Any) -> None:
    engine, settings, _, client = env
    jid = _job(engine, status="queued", slurm_job_id=987654)
    Reconciler(engine, settings, client).cycle()
    assert _status(engine, jid).status == "queued"


def test_failed_job_gets_a_clear_error(env: Any) -> None:
    engine, settings, fake, client = env
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)))
    jid = _job(engine, status="running", slurm_job_id=sid)
    fake.start(sid)
    fake.finish(sid, "OUT_OF_MEMORY", "0:9")
    fake.age_out(sid)
    Reconciler(engine, settings, client).cycle()
    job = _status(engine, jid)
    assert job.status == "failed" and job.error and job.error["code"] == "oom"
    assert "out of memory" in job.error["message"]


def test_interrupted_submission_is_adopted_by_name(env: Any) -> None:
    engine, settings, fake, client = env
    jid = _job(engine)   # validating_files, no slurm id: sbatch ran, the gateway died before recording it
    sid = client.submit(JobScript(jid, "acme", "q", "/srv/x", ("true",)))
    Reconciler(engine, settings, client).cycle()
    job = _status(engine, jid)
    assert job.status == "queued" and job.slurm_job_id == sid


def test_interrupted_submission_never_trusts_a_spec_from_tenant_storage(env: Any) -> None:
    # spec.json lives in tenant storage: the tenant can rewrite it. Recovery rebuilds the spec from the
    # gateway's own record; a planted spec (here one pointing the job elsewhere) is never submitted.
    # (Resubmission from the record runs end to end in tests/reliability/test_faults_gateway.py.)
    engine, settings, fake, client = env
    jid = _job(engine)
    spec_dir = tenant_root(settings.storage_root, "acme") / "jobs" / jid
    spec_dir.mkdir(parents=True)
    (spec_dir / "spec.json").write_text('{"job_dir": "/srv/slurm-finetune/tenants/victim/jobs/x"}')
    submitted = []

    def submit(job: FineTuningJob, spec: dict[str, Any], tenant: str) -> tuple[int, str]:
        submitted.append(spec)
        return client.submit(JobScript(job.id, tenant, "ft-small", spec["job_dir"], ("true",))), "ft-small"

    rec = Reconciler(engine, settings, client, submit)
    rec.cycle()
    rec.cycle()
    assert submitted == []          # the row's model is not in the catalog: nothing to rebuild from
    job = _status(engine, jid)
    assert job.status == "failed" and job.error and job.error["code"] == "submission_lost"
    assert [j for j in fake.jobs.values() if j.name == jid] == []


def test_interrupted_without_spec_fails_clearly(env: Any) -> None:
    engine, settings, _, client = env
    jid = _job(engine)
    Reconciler(engine, settings, client, lambda *a: (1, "q")).cycle()
    job = _status(engine, jid)
    assert job.status == "failed" and job.error and job.error["code"] == "submission_lost"
    with Session(engine) as s:
        assert s.exec(select(FineTuningJob).where(FineTuningJob.status == JobState.QUEUED.value)).first() is None
