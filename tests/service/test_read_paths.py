"""The hot read routes (retrieve, list and events of fine-tuning jobs; issue 20) answer byte for byte
what the ORM path answers: ``job_object`` / ``event_object`` over the rows ``services.jobreads`` loads,
encoded by FastJSON. Jobs in every shape (queued with a start estimate, running with internal progress
keys, failed with an error, succeeded with results, continued, in a sweep); the official openai SDK
parses each; another tenant gets 404 for every id and an empty list."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import Session, select

from gateway.access.tokens import Principal
from gateway.api.fastjson import FastJSON
from gateway.api.jobs import event_object, job_object
from gateway.models import DataFile, FineTuningJob, JobEvent, Role, Tenant, utcnow
from gateway.services import jobreads
from tests.service.conftest import TENANT_A, TENANT_B, Gateway

pytestmark = pytest.mark.service


def _seed(gw: Gateway) -> list[str]:
    now = utcnow()
    with Session(gw.app.state.engine) as s:
        tid = s.exec(select(Tenant).where(Tenant.name == TENANT_A)).one().id
        assert tid is not None
        f = DataFile(tenant_id=tid, filename="t.jsonl", bytes=10, sha256="1" * 64, status="processed")
        s.add(f)
        shapes = [
            dict(status="queued", expected_start=now + timedelta(minutes=5), estimated_finish=now + timedelta(hours=1),
                 qos="ft-small", slurm_job_id=11, hyperparameters={"epochs": 2, "learning_rate": 4e-4}, seed=7),
            dict(status="running", phase="training", attempt=1, slurm_job_id=12, started_at=now,
                 progress={"step": 3, "total_steps": 9, "loss": 1.5, "window": [[1, 2, 3, 4, 0]], "seen_at": 1.0,
                           "node": "n1", "fired": {"stall": 1}, "failure": None, "tokens_per_s": 12.5},
                 hyperparameters={"seed": 3, "lora_r": 8}, meta={"team": "nlp", "run": "a"}),
            dict(status="failed", finished_at=now, error={"code": "user_error", "message": "diverged", "param": None,
                                                          "reason": "user_error"}, cleanup="confirmed",
                 stop_confirmed_at=now),
            dict(status="succeeded", finished_at=now, fine_tuned_model="ft:tiny-chat:svc-a:x:ftjob-1",
                 result_files=["file-a", "file-b"], trained_tokens=98765, suffix="x", validation_file=f.id,
                 gpus=2, nodes=2, fsdp=True),
            dict(status="cancelled", parent_model="ft:tiny-chat:svc-a::ftjob-0", init_file=f.id, sweep_id="sweep-1",
                 cancel_requested_at=now, hyperparameters={}),
            dict(status="validating_files"),
        ]
        ids = []
        for i, extra in enumerate(shapes):
            job = FineTuningJob(tenant_id=tid, training_file=f.id, model="tiny-chat",
                                created_at=now - timedelta(seconds=len(shapes) - i), **extra)  # type: ignore[arg-type]
            s.add(job)
            s.flush()
            ids.append(job.id)
            for k in range(i + 2):
                s.add(JobEvent(job_id=job.id, message=f"event {k} of {job.id}", level="warn" if k % 2 else "info",
                               type="metrics" if k % 3 == 0 else "message", data={"step": k} if k % 2 else None))
        s.commit()
    return ids


def _principal(gw: Gateway, name: str) -> Principal:
    with Session(gw.app.state.engine) as s:
        t = s.exec(select(Tenant).where(Tenant.name == name)).one()
    return Principal(token_id=0, role=Role.MEMBER, tenant_id=t.id, tenant_name=name, unix_user=t.unix_user)


def _listing(rows: list[dict], more: bool) -> bytes:
    return bytes(FastJSON({"object": "list", "data": rows, "has_more": more}).body)


def test_retrieve_list_and_events_answer_what_the_orm_path_answers(gw: Gateway) -> None:
    from openai.types.fine_tuning import FineTuningJob as OpenAIJob
    from openai.types.fine_tuning import FineTuningJobEvent as OpenAIEvent

    ids = _seed(gw)
    me = _principal(gw, TENANT_A)
    with Session(gw.app.state.engine) as s:
        for jid in ids:
            r = gw.client.get(f"/v1/fine_tuning/jobs/{jid}", headers=gw.auth(TENANT_A))
            want = FastJSON(job_object(jobreads.get_job(session=s, principal=me, job_id=jid), TENANT_A)).body
            assert r.status_code == 200 and r.content == want, (r.content, want)
            OpenAIJob.model_validate(r.json())
            for q, after in (("?limit=2", None), ("?limit=100", None), ("?limit=1&after=", "x")):
                cursor = None
                if after:
                    events, _ = jobreads.list_events(session=s, principal=me, job_id=jid, after=None, limit=1)
                    cursor = events[0].id
                    q = f"?limit=1&after=ftevent-{cursor}"
                r = gw.client.get(f"/v1/fine_tuning/jobs/{jid}/events{q}", headers=gw.auth(TENANT_A))
                limit = int(q.split("limit=")[1].split("&")[0])
                rows, more = jobreads.list_events(session=s, principal=me, job_id=jid, after=cursor, limit=limit)
                assert r.status_code == 200 and r.content == _listing([event_object(e) for e in rows], more)
                for e in r.json()["data"]:
                    OpenAIEvent.model_validate(e)
        for q, after in (("?limit=20", None), ("?limit=2", None), ("?limit=2", ids[3]), ("?limit=100", ids[0])):
            r = gw.client.get(f"/v1/fine_tuning/jobs{q}" + (f"&after={after}" if after else ""),
                              headers=gw.auth(TENANT_A))
            rows, more = jobreads.list_jobs(session=s, principal=me, after=after, limit=int(q.split("=")[1]))
            assert r.status_code == 200 and r.content == _listing([job_object(j, TENANT_A) for j in rows], more)
        assert len(gw.client.get("/v1/fine_tuning/jobs?limit=100", headers=gw.auth(TENANT_A)).json()["data"]) == 6


def test_another_tenant_gets_404_for_every_id_and_an_empty_list(gw: Gateway) -> None:
    ids = _seed(gw)
    for jid in ids:
        for path in (f"/v1/fine_tuning/jobs/{jid}", f"/v1/fine_tuning/jobs/{jid}/events",
                     f"/v1/fine_tuning/jobs?after={jid}"):
            r = gw.client.get(path, headers=gw.auth(TENANT_B))
            assert r.status_code == 404 and jid in r.json()["error"]["message"], r.text
            assert "svc-a" not in r.text
    missing = gw.client.get("/v1/fine_tuning/jobs/ftjob-000000000000000000000000", headers=gw.auth(TENANT_B))
    foreign = gw.client.get(f"/v1/fine_tuning/jobs/{ids[0]}", headers=gw.auth(TENANT_B))
    assert missing.json()["error"].keys() == foreign.json()["error"].keys()
    assert gw.client.get("/v1/fine_tuning/jobs", headers=gw.auth(TENANT_B)).json() == \
        {"object": "list", "data": [], "has_more": False}
