"""Files that expire, the retention sweeper and the prune of a succeeded job's training state, on SQLite
and PostgreSQL, through the real storage broker (tenant files owned by the tenants' unix users).

The sweeper's pass runs here as the leader runs it (``services.retention.sweep_pass``), its clock given
(``now``) instead of slept through; ``test_the_reconcile_cycle_is_not_slowed_by_a_big_sweep`` runs the
reconciler's own loop with the sweeper thread beside it."""

from __future__ import annotations

import os
import pwd
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlmodel import Session, select

from gateway.access.tokens import authenticate
from gateway.config import Settings, get_settings
from gateway.errors import ServiceError
from gateway.jobs.reconciler import Reconciler
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, JobEvent, Tenant, utcnow
from gateway.services.jobcreate import usable_file
from gateway.services.retention import sweep_pass
from gateway.state import JobState
from gateway.storage import layout, storage_for
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, chat_lines, cli_over
from tests.service.test_staff_access import audit_key  # noqa: F401 - autouse: a key file per test

pytestmark = pytest.mark.service


@pytest.fixture
def gw(settings: Settings) -> Iterator[Gateway]:
    """The service gateway with a one-second lower bound for expires_after (a site's is an hour), and no
    sweeper of its own (these tests run the passes)."""
    g = Gateway(settings.model_copy(update={"file_expiry_min_s": 1, "sweep_interval_s": 0}))
    yield g
    g.app.state.engine.dispose()


def upload(gw: Gateway, content: bytes, seconds: int | str | None = None, who: str = TENANT_A,
           anchor: str | None = None, no_anchor: bool = False) -> Any:
    """POST /v1/files; with ``seconds``, the anchor ``created_at`` unless ``anchor`` names another or
    ``no_anchor``; an ``anchor`` given is sent even without seconds."""
    extra = {} if seconds is None else {"expires_after[seconds]": str(seconds)}
    if anchor is not None or (seconds is not None and not no_anchor):
        extra["expires_after[anchor]"] = anchor or "created_at"
    return gw.client.post("/v1/files", headers=gw.auth(who), data={"purpose": "fine-tune", **extra},
                          files={"file": ("train.jsonl", content, "application/jsonl")})


def stored(gw: Gateway, sha256: str, tenant: str = TENANT_A) -> Path:
    return layout.tenant_root(gw.settings.storage_root, tenant).joinpath(*layout.dataset(sha256))


def sweep(gw: Gateway, after_s: float = 0.0, **kw: Any) -> Any:
    return sweep_pass(gw.app.state.engine, gw.settings, storage=storage_for(gw.settings),
                      now=utcnow() + timedelta(seconds=after_s), **kw)


def audit(gw: Gateway, who: str = TENANT_A) -> list[dict[str, Any]]:
    r = gw.client.get("/v1/audit", headers=gw.auth(who))
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def test_the_official_openai_client_sends_expires_after(gw: Gateway) -> None:
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key=gw.tokens[TENANT_A], http_client=gw.client,
                    max_retries=0)
    f = client.files.create(file=("train.jsonl", chat_lines(12)), purpose="fine-tune",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.expires_at
    plain = client.files.create(file=("train.jsonl", chat_lines(12)), purpose="fine-tune")
    assert plain.expires_at is None
    assert plain.id != f.id, "an upload that expires is never merged with one that does not"


def test_the_tenant_cli_uploads_with_an_expiry(gw: Gateway, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_lines(12, start=900))
    code, out = cli_over(gw, monkeypatch)(gw.tokens[TENANT_A], "files", "upload", str(path), "--expires-after", "7200")
    assert code == 0 and "expires 20" in out and "(then the gateway deletes it)" in out, out


def test_the_openapi_document_declares_this_gateways_expiry_bounds(gw: Gateway) -> None:
    """A schema-valid upload is one the gateway accepts: the bounds come from its settings (here 1 s),
    so a client generated from /openapi.json never sends a value the gateway answers 400 to."""
    doc = gw.client.get("/openapi.json").json()
    form = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    seconds = form["properties"]["expires_after[seconds]"]
    assert (seconds["minimum"], seconds["maximum"]) == (1, 2592000), seconds
    assert upload(gw, chat_lines(12, start=40), seconds["minimum"]).status_code == 200
    assert upload(gw, chat_lines(12, start=41), seconds["minimum"] - 1).status_code == 400
    # seconds alone count from created_at, the only anchor (the schema lets a client leave it out)
    alone = upload(gw, chat_lines(12, start=42), 3600, no_anchor=True)
    assert alone.status_code == 200 and alone.json()["expires_at"] == alone.json()["created_at"] + 3600, alone.text
    assert form["dependentRequired"] == {"expires_after[anchor]": ["expires_after[seconds]"]}


@pytest.mark.parametrize(("seconds", "anchor", "says"), [
    (0, "created_at", "from 1 to 2592000"),
    (2592001, "created_at", "from 1 to 2592000"),
    ("3600.5", "created_at", "integer"),
    ("soon", "created_at", "integer"),
    (3600, "last_active_at", "must be 'created_at'"),
    (None, "created_at", "without expires_after[seconds]"),
])
def test_bad_expires_after_is_a_clear_400_and_keeps_nothing(gw: Gateway, seconds: Any, anchor: str,
                                                            says: str) -> None:
    r = upload(gw, chat_lines(12, start=7), seconds, anchor=anchor)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "expires_after" and says in err["message"], err
    datasets = layout.tenant_root(gw.settings.storage_root, TENANT_A).joinpath(layout.DATASETS)
    assert not [p for p in datasets.iterdir() if not p.name.startswith(".")] if datasets.exists() else True


def test_an_expired_file_is_gone_after_the_next_pass_and_a_queued_jobs_file_stays(gw: Gateway) -> None:
    a = upload(gw, chat_lines(12), 2).json()
    used = upload(gw, chat_lines(12, start=100), 2).json()
    kept = upload(gw, chat_lines(12, start=200)).json()                 # never expires
    twin = upload(gw, chat_lines(12, start=200), 2).json()              # the same bytes as ``kept``, expiring
    assert twin["id"] != kept["id"] and twin["expires_at"] is not None
    engine = gw.app.state.engine
    with Session(engine) as s:
        tid = s.exec(select(Tenant.id).where(Tenant.name == TENANT_A)).one()
        job = FineTuningJob(tenant_id=tid, status=JobState.QUEUED.value, training_file=used["id"], model="tiny-chat")
        s.add(job)
        s.commit()
        job_id = job.id
    assert sweep(gw).count == 0, "nothing has expired yet"
    report = sweep(gw, after_s=3)
    assert report.deleted == {"file": 2} and report.held == 1, report
    assert gw.client.get(f"/v1/files/{a['id']}", headers=gw.auth(TENANT_A)).status_code == 404
    assert not stored(gw, _sha(gw, a["id"])).exists(), "its bytes left the tenant's storage"
    assert gw.client.get(f"/v1/files/{twin['id']}", headers=gw.auth(TENANT_A)).status_code == 404
    assert stored(gw, _sha(gw, kept["id"])).exists(), "an identical live upload keeps the shared bytes"
    assert gw.client.get(f"/v1/files/{kept['id']}/content", headers=gw.auth(TENANT_A)).content == chat_lines(12, 200)
    # the queued job's file stays, bytes and all, until that job ends
    assert gw.client.get(f"/v1/files/{used['id']}", headers=gw.auth(TENANT_A)).status_code == 200
    assert stored(gw, _sha(gw, used["id"])).exists()
    entries = [e for e in audit(gw) if e["action"] == "file.expire"]
    assert {e["resource"] for e in entries} == {a["id"], twin["id"]}
    assert all(e["actor"] == "retention sweeper" for e in entries)
    assert any("bytes freed" in e["reason"] for e in entries) and any("bytes stay" in e["reason"] for e in entries)
    assert not [e for e in audit(gw, TENANT_B) if e["action"].startswith("file.")], "tenant B sees none of it"
    with Session(engine) as s:         # the job ends (cancelled)
        s.execute(sa.update(FineTuningJob).where(FineTuningJob.id == job_id).values(status=JobState.CANCELLED.value,
                                                                                    finished_at=utcnow()))
        s.commit()
    report = sweep(gw, after_s=3)
    assert report.deleted == {"file": 1} and report.held == 0, report
    assert gw.client.get(f"/v1/files/{used['id']}", headers=gw.auth(TENANT_A)).status_code == 404
    assert not stored(gw, _sha(gw, used["id"])).exists()
    assert sweep(gw, after_s=3).count == 0, "done once"


def test_an_expired_file_starts_no_job_before_the_sweeper_reaches_it(gw: Gateway) -> None:
    f = upload(gw, chat_lines(12), 1).json()
    time.sleep(1.1)
    with Session(gw.app.state.engine) as s:
        principal = authenticate(session=s, token=gw.tokens[TENANT_A])
        assert principal is not None
        with pytest.raises(ServiceError, match="expired at .* it cannot start a job") as e:
            usable_file(s, principal, f["id"], "training_file")
    assert e.value.param == "training_file"


def _sha(gw: Gateway, file_id: str) -> str:
    with Session(gw.app.state.engine) as s:
        row = s.get(DataFile, file_id)
        assert row is not None
        return row.sha256


def _as_tenant(path: Path, tenant: str = TENANT_A) -> None:
    try:
        pw = pwd.getpwnam(f"sft-{tenant}")
    except KeyError:
        return
    for p in [path, *path.rglob("*")]:
        os.lchown(p, pw.pw_uid, pw.pw_gid)


def _job_with_state(gw: Gateway, status: str, steps: list[int], kept: list[int]) -> tuple[str, int]:
    """A job row in ``status`` whose directory holds checkpoints of ``steps`` and an attempt's staging (as
    a trainer leaves them), whose publication kept ``kept`` as checkpoint tars; (job id, bytes on disk)."""
    engine = gw.app.state.engine
    with Session(engine) as s:
        tid = s.exec(select(Tenant.id).where(Tenant.name == TENANT_A)).one()
        if s.get(DataFile, "file-x") is None:        # what the job trained on (PostgreSQL checks the key)
            s.add(DataFile(id="file-x", tenant_id=tid, filename="x", bytes=0, sha256="0" * 64, status="processed"))
            s.flush()
        job = FineTuningJob(tenant_id=tid, status=status, training_file="file-x", model="tiny-chat",
                            finished_at=utcnow(), slurm_job_id=4242)
        s.add(job)
        art = "art-" + job.id[-24:]
        for step in steps:
            s.add(JobCheckpoint(job_id=job.id, step=step, path=f"checkpoints/step-{step}"))
        for step in kept:
            s.add(DataFile(tenant_id=tid, filename=f"{job.id}-{layout.checkpoint_result(step)}", bytes=1,
                           sha256="0" * 64, path=layout.result_path(art, layout.checkpoint_result(step)),
                           job_id=job.id, purpose="fine-tune-results", status="processed"))
        s.commit()
        job_id = job.id
    root = layout.tenant_root(gw.settings.storage_root, TENANT_A)
    for step in kept:
        d = root.joinpath(*layout.checkpoint(job_id, step))
        d.mkdir(parents=True)
        (d / "adapter.safetensors").write_bytes(os.urandom(1000 + step))
        (d / "state.pt").write_bytes(os.urandom(3000))
        (d / "COMPLETE").write_bytes(b"")
    staging = root.joinpath(*layout.staging(job_id, 0))
    staging.mkdir(parents=True)
    (staging / "adapter_model.safetensors").write_bytes(os.urandom(777))
    for name in ("events.jsonl", "slurm-4242.out"):
        (root.joinpath(*layout.job(job_id)) / name).write_bytes(b"x" * 50)
    _as_tenant(root.joinpath(*layout.job(job_id)).parent)
    on_disk = sum(p.stat().st_size for top in layout.training_state(job_id)
                  for p in root.joinpath(*top).rglob("*") if p.is_file())
    return job_id, on_disk


def test_a_succeeded_jobs_training_state_goes_once_and_the_freed_bytes_are_reported(gw: Gateway) -> None:
    job_id, on_disk = _job_with_state(gw, JobState.SUCCEEDED.value, steps=[1, 2, 3, 4, 5], kept=[3, 5])
    failed_id, _ = _job_with_state(gw, JobState.FAILED.value, steps=[1], kept=[])
    report = sweep(gw)
    assert report.deleted == {"prune": 1} and report.freed_bytes == on_disk, report
    root = layout.tenant_root(gw.settings.storage_root, TENANT_A)
    assert not any(root.joinpath(*p).exists() for p in layout.training_state(job_id))
    assert root.joinpath(*layout.job_file(job_id, "events.jsonl")).exists(), "the logs stay (no policy)"
    assert any(root.joinpath(*p).exists() for p in layout.training_state(failed_id)), "a failed job's stay"
    j = gw.client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=gw.auth(TENANT_A)).json()
    rec = j["progress"]["storage"]
    assert rec["freed_bytes"] == on_disk and rec["kept_steps"] == [3, 5] and rec["removed_steps"] == [1, 2, 4]
    events = gw.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=gw.auth(TENANT_A)).json()["data"]
    prune = [e for e in events if "kept_steps" in e["data"]]
    assert len(prune) == 1 and prune[0]["data"]["freed_bytes"] == on_disk, events
    assert [e["resource"] for e in audit(gw) if e["action"] == "job.prune"] == [job_id]
    assert sweep(gw).count == 0, "pruned once (progress.storage.pruned_at, a JSON path on either database)"


def test_the_policy_set_by_the_cli_ages_out_data_and_logs(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import main

    monkeypatch.setenv("SFT_DATABASE_URL", gw.settings.database_url)
    monkeypatch.setenv("SFT_STORAGE_ROOT", str(gw.settings.storage_root))
    get_settings.cache_clear()
    res = CliRunner().invoke(main, ["admin", "tenant", "retention", TENANT_A, "--datasets", "30", "--logs", "7",
                                    "--results", "off", "--json"])
    assert res.exit_code == 0, res.output
    assert '"datasets": 30' in res.output and '"results": null' in res.output and '"logs": 7' in res.output
    bad = CliRunner().invoke(main, ["admin", "tenant", "retention", TENANT_A, "--logs", "-3"])
    assert bad.exit_code != 0 and "--logs" in bad.output
    old = upload(gw, chat_lines(12)).json()
    young = upload(gw, chat_lines(12, start=300)).json()
    job_id, _ = _job_with_state(gw, JobState.CANCELLED.value, steps=[1], kept=[])
    engine = gw.app.state.engine
    with Session(engine) as s:
        s.execute(sa.update(DataFile).where(DataFile.id == old["id"]).values(created_at=utcnow() - timedelta(days=31)))
        s.execute(sa.update(FineTuningJob).where(FineTuningJob.id == job_id)
                  .values(finished_at=utcnow() - timedelta(days=8)))
        s.commit()
    dry = CliRunner().invoke(main, ["admin", "sweep", "--dry-run", "--json"])
    assert dry.exit_code == 0 and old["id"] in dry.output and f'"what": "logs", "tenant": "{TENANT_A}"' in dry.output
    done = CliRunner().invoke(main, ["admin", "sweep", "--json"])
    get_settings.cache_clear()
    assert done.exit_code == 0 and '"file": 1' in done.output and '"logs": 1' in done.output, done.output
    assert gw.client.get(f"/v1/files/{old['id']}", headers=gw.auth(TENANT_A)).status_code == 404
    assert gw.client.get(f"/v1/files/{young['id']}", headers=gw.auth(TENANT_A)).status_code == 200
    root = layout.tenant_root(gw.settings.storage_root, TENANT_A)
    assert not any(root.joinpath(*p).exists() for p in layout.job_logs(job_id, 4242))
    assert any(root.joinpath(*p).exists() for p in layout.training_state(job_id)), "no checkpoints policy: kept"
    with Session(engine) as s:
        msgs = [e.message for e in s.exec(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert any(m.startswith("Logs removed, older than the tenant's retention of 7 days") for m in msgs), msgs
    actions = [e["action"] for e in audit(gw)]
    assert {"tenant.retention", "file.retention", "job.logs"} <= set(actions), actions


def test_a_pass_is_bounded_by_its_item_limit_and_its_time_budget(gw: Gateway) -> None:
    ids = [upload(gw, chat_lines(12, start=1000 + 20 * i), 1).json()["id"] for i in range(7)]
    first = sweep(gw, after_s=2, limit=3)
    assert first.count == 3 and first.stopped == "limit", first
    broke = sweep(gw, after_s=2, budget_s=1e-9)
    assert broke.count == 0 and broke.stopped == "budget", broke
    rest = sweep(gw, after_s=2)
    assert rest.count == 4 and rest.stopped is None, rest
    assert all(gw.client.get(f"/v1/files/{i}", headers=gw.auth(TENANT_A)).status_code == 404 for i in ids)


def test_the_reconcile_cycle_is_not_slowed_by_a_big_sweep(gw: Gateway) -> None:
    """The reconciler's own loop with the sweeper beside it: ``N`` expired files take one pass of seconds,
    and meanwhile the cycles go on at their interval, each as short as without a sweep."""
    n = 150
    for i in range(n):
        assert upload(gw, chat_lines(12, start=5000 + 20 * i), 1).status_code == 200
    time.sleep(1.1)              # they expire (the loop's clock is the real one)
    settings = gw.settings.model_copy(update={"reconcile_interval_s": 0.05, "sweep_interval_s": 3600,
                                              "sweep_max_items": 1000, "sweep_budget_s": 120})
    rec = Reconciler(gw.app.state.engine, settings, client=None)  # type: ignore[arg-type]   # no jobs: no Slurm call
    samples: list[tuple[float, int, float, bool]] = []    # (t, cycles, last cycle seconds, a sweep in flight)
    baseline_cycles: list[float] = []
    rec.sweeper._next = time.monotonic() + 1.0               # one second of cycles without a sweep, then one pass
    loop = threading.Thread(target=rec.run, daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 120
        seen = 0
        while rec.sweeper.passes == 0 or rec.sweeper.running:
            assert time.monotonic() < deadline, "the sweep pass did not end"
            if rec.stats.cycles != seen:
                seen = rec.stats.cycles
                samples.append((time.monotonic(), seen, rec.stats.last_seconds, rec.sweeper.running))
            time.sleep(0.002)
    finally:
        rec.stop.set()
        loop.join(10)
    report = rec.sweeper.last
    assert report is not None and report.deleted == {"file": n}, report
    during = [s for s in samples if s[3]]
    baseline_cycles = [s[2] for s in samples if not s[3]]
    assert len(during) >= 2 and baseline_cycles, samples
    span = during[-1][0] - during[0][0]
    cycles_during = during[-1][1] - during[0][1]
    worst, usual = max(s[2] for s in during), statistics.median(baseline_cycles)
    print(f"\nsweep pass: {n} files in {report.seconds:.2f}s; cycles meanwhile: {cycles_during} in {span:.2f}s "
          f"(interval 0.05s), cycle time median {statistics.median(s[2] for s in during) * 1000:.1f} ms, "
          f"worst {worst * 1000:.1f} ms; without a sweep: median {usual * 1000:.1f} ms")
    # the cycles kept their pace: at least a third of what the interval allows (2 cores, the GIL shared)...
    assert cycles_during >= span / (settings.reconcile_interval_s + usual) / 3, (cycles_during, span)
    # ...and none of them waited for the pass: the worst is a small fraction of the pass
    assert worst < report.seconds / 4, (worst, report.seconds)
