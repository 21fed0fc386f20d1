"""Reconciler decisions against the argv-level FakeSlurm and a real SQLite file:
batching, a failed query changing nothing, recovery of interrupted submissions, the
trainer's events, and publication against a storage fake that records its verbs."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from gateway.config import Settings
from gateway.db import make_engine, migrate
from gateway.errors import StorageUnavailable
from gateway.jobs.reconciler import Reconciler
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, JobEvent, Tenant, utcnow
from gateway.services.publication import fine_tuned_model_name
from gateway.slurm import JobScript, SlurmClient, SlurmCommandError
from gateway.state import JobState
from gateway.storage.layout import RESULT_NAMES, tenant_root
from tests.slurmfake import FakeSlurm
from trainer.contract.spec import JobSpec


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
        sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)), user="sft-acme")
        fake.start(sid)
        ids.append(_job(engine, status="queued", slurm_job_id=sid))
    fake.calls.clear()
    stats = Reconciler(engine, settings, client).cycle()
    assert stats.jobs == 30 and fake.count("squeue") == 1 and fake.count("sacct") == 0
    assert {_status(engine, j).status for j in ids} == {"running"}


def test_failed_slurm_query_changes_nothing(env: Any) -> None:
    engine, settings, fake, client = env
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)), user="sft-acme")
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
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)), user="sft-acme")
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
    sid = client.submit(JobScript(jid, "acme", "q", "/srv/x", ("true",)), user="sft-acme")
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

    def submit(job: FineTuningJob, spec: JobSpec, tenant: str) -> tuple[int, str]:
        submitted.append(spec)
        return client.submit(JobScript(job.id, tenant, "ft-small", spec.job_dir, ("true",))), "ft-small"

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


def test_an_interrupted_sweep_adopts_its_named_task_and_cancels_the_never_named(env: Any) -> None:
    """The gateway died between a sweep's sbatch and naming its array's tasks: task 0 was named after its
    job (adopted, and released: the hold would keep it pending for ever), tasks 1-2 still carry the
    sweep's name (held, never ran): cancelled, and their jobs go the way of any lost submission."""
    engine, settings, fake, client = env
    with Session(engine) as s:
        jobs = [FineTuningJob(tenant_id=1, training_file="file-1", model="m", sweep_id="ftsweep-x",
                              created_at=utcnow() - timedelta(hours=2)) for _ in range(3)]
        s.add_all(jobs)
        s.commit()
        ids = [j.id for j in jobs]
    array = client.submit_array([JobScript(j, "acme", "q", f"/srv/jobs/{j}", ("true",)) for j in ids],
                                name="ftsweep-x", user="sft-acme")
    client.name_task(array, 0, ids[0])
    Reconciler(engine, settings, client).cycle()
    task = {j.task: j for j in fake.jobs.values() if j.array_id == array}
    assert _status(engine, ids[0]).status == "queued" and _status(engine, ids[0]).slurm_job_id == task[0].job_id
    assert not task[0].held and task[0].state == "PENDING"
    assert task[1].state == task[2].state == "CANCELLED"
    assert [(_status(engine, j).status, (_status(engine, j).error or {}).get("code")) for j in ids[1:]] == \
        [("failed", "submission_lost")] * 2


def _running(engine: Any, client: SlurmClient, fake: FakeSlurm, **kw: Any) -> tuple[str, int]:
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)), user="sft-acme")
    fake.start(sid)
    return _job(engine, status="running", slurm_job_id=sid, **kw), sid


def _events(settings: Settings, job_id: str, *lines: str | dict[str, Any]) -> None:
    d = tenant_root(settings.storage_root, "acme") / "jobs" / job_id
    d.mkdir(parents=True, exist_ok=True)
    with (d / "events.jsonl").open("a") as f:
        f.write("".join(ln if isinstance(ln, str) else json.dumps(ln) + "\n" for ln in lines))


def test_trainer_events_become_progress_checkpoints_and_tokens(env: Any) -> None:
    engine, settings, fake, client = env
    jid, _ = _running(engine, client, fake)
    step = {"type": "metrics", "total_steps": 10, "loss": 1.5, "lr": 1e-4, "tokens_per_s": 9.0,
            "elapsed_s": 2.0, "epoch": 0, "tokens": 100}
    _events(settings, jid, {"type": "phase", "phase": "saving"}, "not json\n", "[1, 2]\n",
            {**step, "step": 1}, {**step, "step": 2, "loss": 1.25},
            {"type": "checkpoint", "attempt": 0, "step": 2, "path": "attempts/0/ckpt-2"},
            {"type": "eval", "when": "after", "step": 2, "loss": 1.0, "perplexity": 2.7, "token_accuracy": 0.5},
            {**step, "type": "metrics", "step": 2, "attempt": 1},      # a resumed attempt redoes step 2
            '{"type": "metrics", "step": 3')                             # no newline yet: not read
    Reconciler(engine, settings, client).cycle()
    job = _status(engine, jid)
    assert job.phase == "evaluating" and job.attempt == 1 and job.trained_tokens == 200
    assert job.progress and job.progress["step"] == 2 and job.progress["counted_step"] == 2
    assert job.progress["evals"] == [{"when": "after", "step": 2, "loss": 1.0, "perplexity": 2.7,
                                      "token_accuracy": 0.5}]
    assert job.estimated_finish is not None
    path = tenant_root(settings.storage_root, "acme") / "jobs" / jid / "events.jsonl"
    assert job.events_offset == path.read_bytes().rfind(b"\n") + 1
    with Session(engine) as s:
        ckpts = s.exec(select(JobCheckpoint).where(JobCheckpoint.job_id == jid)).all()
        messages = [e.message for e in s.exec(select(JobEvent).where(JobEvent.job_id == jid))]
    assert [(c.attempt, c.step, c.path) for c in ckpts] == [(0, 2, "attempts/0/ckpt-2")]
    assert "Phase: saving" in messages and "Step 2/10: training loss=1.2500" in messages
    assert "Attempt 1 started (requeued run resumes from its checkpoint)" in messages
    assert "Checkpoint saved at step 2" in messages


def test_malformed_numbers_in_events_neither_stall_the_job_nor_reach_a_message(env: Any) -> None:
    # events.jsonl is the tenant's file: values of the wrong type must not raise in the
    # reconciler (the offset would never move past the line) nor be formatted as numbers
    engine, settings, fake, client = env
    jid, _ = _running(engine, client, fake)
    _events(settings, jid,
            {"type": "metrics", "step": 1, "total_steps": 5, "loss": "NaN-ish", "elapsed_s": "soon", "tokens": 9},
            {"type": "eval", "when": "step", "step": "1", "loss": [1]},
            {"type": "checkpoint", "attempt": "zero", "step": {"n": 1}, "path": "checkpoints/step-1"},
            {"type": "early_stop", "step": 4, "best_step": 2, "best_loss": 0.5},
            {"type": "early_stop", "step": True, "best_step": "x", "best_loss": "low"})
    Reconciler(engine, settings, client).cycle()
    job = _status(engine, jid)
    path = tenant_root(settings.storage_root, "acme") / "jobs" / jid / "events.jsonl"
    assert job.events_offset == path.stat().st_size
    assert job.progress and job.progress["early_stop"] == {"step": None, "best_step": None, "best_loss": None}
    with Session(engine) as s:
        messages = [e.message for e in s.exec(select(JobEvent).where(JobEvent.job_id == jid))]
        ckpts = s.exec(select(JobCheckpoint).where(JobCheckpoint.job_id == jid)).all()
    assert "Step 1/5: training loss=?" in messages and "Eval (step, step None): loss=?" in messages
    assert [(c.attempt, c.step) for c in ckpts] == [(0, 0)]
    assert ("Early stopping at step 4: validation loss stopped improving; the adapter of step 2 "
            "(loss 0.5000) is published") in messages


def test_trainer_failure_message_is_the_error(env: Any) -> None:
    engine, settings, fake, client = env
    jid, sid = _running(engine, client, fake)
    _events(settings, jid, {"type": "failed", "reason": "user_error", "message": "line 3: no messages"})
    fake.finish(sid, "FAILED", "1:0")
    fake.age_out(sid)
    Reconciler(engine, settings, client).cycle()
    job = _status(engine, jid)
    assert job.status == "failed" and job.cleanup == "pending" and job.error == {
        "code": "internal", "message": "line 3: no messages", "param": None, "reason": "internal"}


def test_requeue_then_start_again(env: Any) -> None:
    engine, settings, fake, client = env
    jid, sid = _running(engine, client, fake)
    fake.jobs[sid].state = "PENDING"
    rec = Reconciler(engine, settings, client)
    rec.cycle()
    assert _status(engine, jid).status == "queued"
    fake.start(sid)
    rec.cycle()
    assert _status(engine, jid).status == "running"


class _FakeStore:
    """Tenant storage as publication sees it: records what it was asked to do."""

    def __init__(self, evaluation: dict[str, Any], fail_commit: bool = False):
        self.evaluation, self.fail_commit = evaluation, fail_commit
        self.committed: list[tuple[str, str]] = []
        self.removed: list[Any] = []

    def tenant(self, name: str) -> _FakeStore:
        return self

    def read_events(self, offsets: dict[str, int]) -> dict[str, bytes]:
        return {}

    def sweep(self, min_age_s: float) -> int:
        return 0

    def publish_build(self, job_id: str, attempt: int, model_digest: str | None,
                      checkpoint_steps: list[int] | None = None) -> dict[str, Any]:
        return {"name": ".pub-1", "evaluation": self.evaluation,
                "results": {n: [1, "a" * 64] for n in RESULT_NAMES}}

    def publish_commit(self, name: str, art_id: str) -> None:
        if self.fail_commit:
            raise StorageUnavailable("broker gone")
        self.committed.append((name, art_id))

    def remove(self, paths: list[Any]) -> int:
        self.removed.append(paths)
        return len(paths)


GOOD_EVAL = {"before": {"loss": 2.0}, "after": {"loss": 1.0}}


def _reconciler(engine: Any, settings: Settings, client: SlurmClient, store: _FakeStore) -> Reconciler:
    rec = Reconciler(engine, settings, client)
    rec.storage = store  # type: ignore[assignment]
    return rec


def test_completed_job_is_published_in_the_same_cycle(env: Any) -> None:
    engine, settings, fake, client = env
    jid, sid = _running(engine, client, fake, suffix="v1")
    fake.finish(sid, "COMPLETED", "0:0")
    store = _FakeStore(GOOD_EVAL)
    stats = _reconciler(engine, settings, client, store).cycle()
    job = _status(engine, jid)
    assert stats.published == 1 and job.status == "succeeded" and job.cleanup == "pending"
    assert job.fine_tuned_model == fine_tuned_model_name(job, "acme") == f"ft:m:acme:v1:{jid}"
    job.suffix = None       # no suffix: no empty field (issue 35)
    assert fine_tuned_model_name(job, "acme") == f"ft:m:acme:{jid}"
    assert [n for n, _ in store.committed] == [".pub-1"] and store.removed == []
    with Session(engine) as s:
        rows = s.exec(select(DataFile).where(DataFile.job_id == jid)).all()
    assert sorted(r.id for r in rows) == sorted(job.result_files or [])
    assert {r.path for r in rows} == {f"artifacts/{store.committed[0][1]}/{n}" for n in RESULT_NAMES}


def test_eval_gate_refuses_and_removes_the_build(env: Any) -> None:
    engine, settings, fake, client = env
    jid = _job(engine, status="publishing", slurm_job_id=4242)
    store = _FakeStore({"before": {"loss": 1.0}, "after": {"loss": 2.0}})
    _reconciler(engine, settings, client, store).cycle()
    job = _status(engine, jid)
    assert job.status == "failed" and job.error and job.error["code"] == "publication_refused"
    assert "eval gate" in job.error["message"] and store.removed == [[("artifacts", ".pub-1")]]


def test_lost_commit_rolls_back_and_removes_the_build(env: Any) -> None:
    engine, settings, fake, client = env
    jid = _job(engine, status="publishing", slurm_job_id=4242)
    store = _FakeStore(GOOD_EVAL, fail_commit=True)
    stats = _reconciler(engine, settings, client, store).cycle()
    job = _status(engine, jid)
    assert job.status == "publishing" and job.version == 0 and stats.errors == [f"{jid}: StorageUnavailable"]
    assert store.removed == [[("artifacts", ".pub-1")]]
    with Session(engine) as s:
        assert s.exec(select(DataFile).where(DataFile.job_id == jid)).all() == []


def test_cancelling_job_is_cancelled_once_slurm_has_no_process(env: Any) -> None:
    engine, settings, fake, client = env
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)), user="sft-acme")
    jid = _job(engine, status="cancelling", slurm_job_id=sid)
    fake.start(sid)
    rec = Reconciler(engine, settings, client)
    rec.cycle()                       # still running: the cancel is (re)sent, the state waits
    assert _status(engine, jid).status == "cancelling"
    fake.finish(sid, "CANCELLED", "0:15")
    fake.age_out(sid)
    rec.cycle()
    job = _status(engine, jid)
    assert job.status == "cancelled" and job.stop_confirmed_at is not None and job.cleanup == "pending"


def _scrub_report(settings: Settings, node: str, job_id: int, outcome: str) -> None:
    path = settings.scrub_report_dir / node / f"{job_id}-epilog.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "kind": "epilog", "job_id": job_id, "node": node, "user": "sft-acme", "started": "2026-12-01T00:00:00+00:00",
        "seconds": 0.1, "outcome": outcome, "failed_steps": [] if outcome == "ok" else ["gpu_wipe"],
        "totals": {"files_removed": 0, "bytes_removed": 0, "processes_killed": 0, "gpu_bytes_wiped": 0},
        "steps": [{"name": "gpu_wipe", "status": outcome, "message": "-", "seconds": 0.1}]}))


def test_a_gang_job_is_clean_only_when_every_node_says_so(env: Any, tmp_path: Path) -> None:
    engine, _, _, client = env
    settings = Settings(storage_root=tmp_path / "s", database_url=f"sqlite:///{tmp_path / 'g.db'}",
                        submission_grace_s=0, scrub_report_dir=tmp_path / "scrub")
    clean = _job(engine, status="succeeded", slurm_job_id=41, cleanup="pending", progress={"node": "gpu[01-02]"})
    dirty = _job(engine, status="succeeded", slurm_job_id=42, cleanup="pending", progress={"node": "gpu01,gpu02"})
    _scrub_report(settings, "gpu01", 41, "ok")
    _scrub_report(settings, "gpu01", 42, "ok")
    _scrub_report(settings, "gpu02", 42, "fail")
    rec = Reconciler(engine, settings, client)
    rec.cycle()
    assert _status(engine, clean).cleanup == "pending"          # gpu02 has not reported yet
    assert _status(engine, dirty).cleanup == "failed"           # one node failed: the whole job's cleanup did
    _scrub_report(settings, "gpu02", 41, "ok")
    rec.cycle()
    assert _status(engine, clean).cleanup == "confirmed"


def test_node_lists_expand_like_slurms() -> None:
    from gateway.slurm.records import SlurmParseError, expand_nodelist

    assert expand_nodelist("vm,vm2") == ["vm", "vm2"]
    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("n[8-10]-ib") == ["n8-ib", "n9-ib", "n10-ib"]
    for bad in ("gpu[01-", "gpu[3-1]", "gpu[a-b]", "x,gpu]1", "n[0-99999]"):
        with pytest.raises(SlurmParseError):
            expand_nodelist(bad)


def test_a_recorded_id_of_another_tenants_job_is_an_alert_never_an_action(env: Any) -> None:
    """A job row that holds another tenant's Slurm id (once, an id a tampered sbatch printed): its
    cancel never reaches that job, nothing Slurm says of it changes the row, and the tenant sees one
    warning; the tenant's other jobs are reconciled as usual."""
    engine, settings, fake, client = env
    fake.accounts.add("beta")
    victim = client.submit(JobScript("v", "beta", "q", "/srv/v", ("true",)), user="sft-beta")
    fake.start(victim)
    bad = _job(engine, status="cancelling", slurm_job_id=victim)
    good, _ = _running(engine, client, fake)
    fake.finish(victim, "CANCELLED", "0:15")       # even an ending of that job is not this job's
    rec = Reconciler(engine, settings, client)
    for _ in range(2):
        rec.cycle()
    assert _status(engine, bad).status == "cancelling" and rec.alerts == 2
    assert not any(c[0] == "scancel" for c in fake.calls)
    with Session(engine) as s:
        warns = [e.message for e in s.exec(select(JobEvent).where(JobEvent.job_id == bad))
                 if "does not act on its records" in e.message]
    assert len(warns) == 1 and "its account is not acme" in warns[0]
    assert _status(engine, good).status == "running"


def test_one_jobs_unreadable_record_fails_that_job_only(env: Any) -> None:
    engine, settings, fake, client = env
    ids = [_running(engine, client, fake) for _ in range(3)]
    broken = ids[1][1]
    real = fake.run

    def mangled(argv, **kw):  # type: ignore[no-untyped-def]
        res = real(argv, **kw)
        if argv[0] == "squeue":
            out = "".join(x.replace("\x1fFAILED\x1f", "\x1fFAILED\x1fextra\x1f") + "\n" if x.startswith(f"{broken}\x1f")
                          else x + "\n" for x in res.stdout.splitlines())
            return type(res)(res.argv, res.returncode, out, res.stderr, res.seconds)
        return res
    fake.run = mangled  # type: ignore[method-assign]
    for _, sid in ids:
        fake.finish(sid, "FAILED", "1:0")
    stats = Reconciler(engine, settings, client).cycle()
    assert not stats.errors
    assert [_status(engine, jid).status for jid, _ in ids] == ["failed", "running", "failed"]


def test_a_job_cancelled_while_queued_waits_for_no_cleanup(env: Any) -> None:
    """No node ever ran it, so no epilog will ever report: its cleanup is none, not ``pending`` for ever
    (the capacity run found such rows, and every cycle read them again). A row an older gateway left
    pending without a node is settled the same way."""
    engine, settings, fake, client = env
    sid = client.submit(JobScript("x", "acme", "q", "/srv/x", ("true",)), user="sft-acme")
    jid = _job(engine, status="cancelling", slurm_job_id=sid)
    fake.finish(sid, "CANCELLED", "0:0")
    fake.age_out(sid)
    old = _job(engine, status="cancelled", slurm_job_id=None, cleanup="pending")
    Reconciler(engine, settings, client).cycle()
    job = _status(engine, jid)
    assert job.status == "cancelled" and job.cleanup is None
    assert _status(engine, old).cleanup is None
    with Session(engine) as s:
        assert "No node cleanup: the job never ran on a node" in [
            e.message for e in s.exec(select(JobEvent).where(JobEvent.job_id == old))]


def test_cycle_quantiles_are_nearest_rank_over_the_latest_cycles() -> None:
    from gateway.jobs.loopstats import RECENT_CYCLES, LoopStats

    stats = LoopStats()
    assert stats.quantiles() == {}
    for i in range(1, 101):
        stats.observe(i / 100)
    assert stats.quantiles() == {0.5: 0.5, 0.9: 0.9, 0.99: 0.99}
    for _ in range(RECENT_CYCLES):
        stats.observe(2.0)          # the oldest fall out
    assert stats.quantiles() == {0.5: 2.0, 0.9: 2.0, 0.99: 2.0} and stats.cycles == 100 + RECENT_CYCLES
