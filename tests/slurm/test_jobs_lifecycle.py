"""Fine-tuning jobs end to end on the real cluster, with the real trainer and a real DB."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, select

from gateway.models import DataFile, FineTuningJob
from gateway.slurm import LocalRunner, SlurmClient
from tests.slurm.livegateway import MODEL, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
A, B = "t-life-a", "t-life-b"
LONG_HP = {"n_epochs": 6, "batch_size_tokens": 256, "max_seq_len": 256, "checkpoint_every_steps": 2,
           "learning_rate_multiplier": 5}


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    # no retention sweeper: a test here reads a succeeded job's staging dir, which the sweeper's prune removes
    g = LiveGateway(tmp_path_factory.mktemp("life"), (A, B), SFT_SWEEP_INTERVAL_S="0")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def small_file(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> str:
    return gw.upload(A, chat_file(tmp_path_factory.mktemp("d") / "train.jsonl", 80, seed=3))


@pytest.fixture(scope="module")
def long_file(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> str:
    return gw.upload(A, chat_file(tmp_path_factory.mktemp("d") / "long.jsonl", 300, seed=4))


@pytest.fixture(scope="module")
def succeeded(gw: LiveGateway, small_file: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job through the official openai client, to succeeded."""
    from openai import OpenAI

    client = OpenAI(base_url=gw.url + "/v1", api_key=gw.tokens[A], max_retries=0)
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=small_file, suffix="e2e",
                                         hyperparameters={"n_epochs": 1}, extra_body={"hyperparameters": {
                                             "n_epochs": 1, "batch_size_tokens": 512, "max_seq_len": 256,
                                             "checkpoint_every_steps": 3, "learning_rate_multiplier": 10}})
    assert job.status in ("validating_files", "queued")
    deadline = time.monotonic() + 300
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(1)
    return {"client": client, "job": job}


def test_openai_client_end_to_end(succeeded: dict, gw: LiveGateway, tmp_path: Path) -> None:
    client, job = succeeded["client"], succeeded["job"]
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:{MODEL}:{A}:e2e:{job.id}"
    assert job.trained_tokens and job.trained_tokens > 0
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=200).data]
    assert "The job has successfully completed" in messages
    assert any(m.startswith("Step ") for m in messages)
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints and checkpoints[0].step_number >= checkpoints[-1].step_number
    names = {}
    for fid in job.result_files:
        meta = client.files.retrieve(fid)
        (tmp_path / meta.filename).write_bytes(client.files.content(fid).read())
        names[meta.filename.split("-", 2)[-1]] = tmp_path / meta.filename
    assert set(names) == {"adapter.tar", "eval.json", "metrics.csv"}
    evaluation = json.loads(names["eval.json"].read_text())
    assert evaluation["after"]["loss"] < evaluation["before"]["loss"]
    with tarfile.open(names["adapter.tar"]) as tar:
        assert all(m.isfile() and not m.name.startswith(("/", "..")) for m in tar.getmembers())
        tar.extractall(tmp_path / "adapter")  # noqa: S202 (members checked above)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer import catalog

    entry = next(e for e in catalog.list_models(STORAGE / "models") if e.name == MODEL)
    base = AutoModelForCausalLM.from_pretrained(STORAGE / "models" / entry.path)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter" / job.id)
    assert any("lora" in n for n, _ in model.named_parameters())
    models = [m.id for m in client.models.list().data]
    assert MODEL in models and job.fine_tuned_model in models


def test_tenant_b_sees_nothing_of_tenant_a(succeeded: dict, gw: LiveGateway) -> None:
    job = succeeded["job"]
    assert gw.api("GET", "/v1/fine_tuning/jobs", B).json()["data"] == []
    for method, path in (("GET", f"/v1/fine_tuning/jobs/{job.id}"), ("POST", f"/v1/fine_tuning/jobs/{job.id}/cancel"),
                         ("GET", f"/v1/fine_tuning/jobs/{job.id}/events"),
                         ("GET", f"/v1/fine_tuning/jobs/{job.id}/checkpoints"),
                         *(("GET", f"/v1/files/{f}/content") for f in job.result_files),
                         ("GET", f"/v1/models/{job.fine_tuned_model}"),
                         ("DELETE", f"/v1/models/{job.fine_tuned_model}")):
        r = gw.api(method, path, B)
        assert r.status_code == 404, (method, path, r.status_code)
    assert job.fine_tuned_model not in [m["id"] for m in gw.api("GET", "/v1/models", B).json()["data"]]


def test_cancel_finished_job_is_409(succeeded: dict, gw: LiveGateway) -> None:
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{succeeded['job'].id}/cancel", A)
    assert r.status_code == 409 and "already succeeded" in r.json()["error"]["message"]


def test_cancel_during_training(gw: LiveGateway, long_file: str) -> None:
    job = gw.create(A, long_file, LONG_HP)
    gw.wait(A, job["id"], lambda j: j["phase"] == "training" and (j["progress"].get("step") or 0) >= 2
            or terminal(j), 240)
    t0 = time.monotonic()
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", A)
    assert r.status_code == 200 and r.json()["status"] == "cancelling"
    again = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", A)
    assert again.status_code == 200 and again.json()["status"] in ("cancelling", "cancelled")
    done = gw.wait(A, job["id"], terminal, 60)
    took = time.monotonic() - t0
    print(f"\ncancel during training: cancelled {took:.1f}s after the request")
    assert done["status"] == "cancelled" and done["stop_confirmed"]
    assert done["result_files"] == [] and done["fine_tuned_model"] is None
    slurm_state = SlurmClient(LocalRunner()).states([done["slurm_job_id"]])[done["slurm_job_id"]]
    assert not slurm_state.active
    assert subprocess.run(["pgrep", "-u", f"sft-{A}", "-f", "trainer"], capture_output=True).returncode == 1
    # what it trained is kept (issue 35): its complete checkpoints became adapters, and nothing else
    kept = [c for c in gw.kept_checkpoints(A, job["id"]) if c["adapter_file"]]
    assert kept, "a job cancelled after step 2 (a checkpoint every 2 steps) keeps a checkpoint"
    name = f"ft:{MODEL}:{job['id']}:ckpt-step-{kept[0]['step_number']}"
    assert kept[0]["fine_tuned_model_checkpoint"] == name
    assert gw.api("GET", f"/v1/models/{name}", A).status_code == 200
    assert gw.api("GET", f"/v1/models/{name}", B).status_code == 404
    assert not list((STORAGE / "tenants" / A / "artifacts").glob(f".pub-{job['id']}*"))
    with Session(gw.engine) as s:
        rows = list(s.exec(select(DataFile).where(DataFile.job_id == job["id"])))
    assert sorted(r.id for r in rows) == sorted(c["adapter_file"] for c in kept)
    assert all(re.fullmatch(rf"{job['id']}-checkpoint-step-\d+\.tar", r.filename) for r in rows), rows
    cleaned = gw.wait(A, job["id"], lambda j: j["cleanup"] in ("confirmed", "failed"), 60)
    assert cleaned["cleanup"] == "confirmed"


def test_same_idempotency_key_20_times_concurrently_makes_one_job(gw: LiveGateway, small_file: str) -> None:
    results: list[httpx.Response] = []
    body = {"model": MODEL, "training_file": small_file, "hyperparameters": {"n_epochs": 1,
            "batch_size_tokens": 512, "max_seq_len": 256}}
    barrier = threading.Barrier(20)

    def post() -> None:
        barrier.wait()
        results.append(gw.api("POST", "/v1/fine_tuning/jobs", A, json=body,
                              headers={"Idempotency-Key": "same-key-42"}))

    threads = [threading.Thread(target=post) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 20, [r.text for r in results if r.status_code != 200]
    ids = {r.json()["id"] for r in results}
    assert len(ids) == 1
    with Session(gw.engine) as s:
        rows = list(s.exec(select(FineTuningJob).where(FineTuningJob.idempotency_key == "same-key-42")))
    assert len(rows) == 1
    other = gw.api("POST", "/v1/fine_tuning/jobs", A, json={**body, "suffix": "different"},
                   headers={"Idempotency-Key": "same-key-42"})
    assert other.status_code == 409
    gw.api("POST", f"/v1/fine_tuning/jobs/{ids.pop()}/cancel", A)


def test_requeue_resumes_from_checkpoint_and_stale_attempt_is_fenced(gw: LiveGateway, small_file: str) -> None:
    job = gw.create(A, small_file, {**LONG_HP, "n_epochs": 4})
    jid = job["id"]
    running = gw.wait(A, jid, lambda j: (j["progress"].get("step") or 0) >= 4 or terminal(j), 240)
    assert running["status"] == "running"
    jdir = STORAGE / "tenants" / A / "jobs" / jid
    subprocess.run(["scontrol", "requeue", str(running["slurm_job_id"])], check=True)
    gw.wait(A, jid, lambda j: j["attempt"] >= 1 or terminal(j), 120)
    # a stale attempt-0 staging that claims to be complete must never be published
    stale = jdir / "attempts" / "0" / "staging"
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "adapter_model.safetensors").write_bytes(b"stale")
    (stale / "manifest.json").write_text(json.dumps({"attempt": 0, "files": {}}))
    (stale / "COMPLETE").write_text("")
    for p in (stale.parent.parent, stale.parent, stale, *stale.iterdir()):   # as if the trainer wrote it
        shutil.chown(p, f"sft-{A}", f"sft-{A}")
    done = gw.wait(A, jid, terminal, 400)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempt"] == 1
    events = [e["message"] for e in gw.api("GET", f"/v1/fine_tuning/jobs/{jid}/events?limit=1000", A).json()["data"]]
    assert any("requeued" in m for m in events) and any(m.startswith("Attempt 1") for m in events)
    trainer_events = [json.loads(x) for x in (jdir / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in trainer_events if e["type"] == "start" and e.get("attempt") == 1]
    assert any(e.get("resumed_from_step", 0) > 0 for e in resumed), "attempt 1 resumed from a checkpoint"
    published = _published_adapter_sha(gw, done)
    assert published == hashlib.sha256((jdir / "attempts/1/staging/adapter_model.safetensors").read_bytes()).hexdigest()


def _published_adapter_sha(gw: LiveGateway, job: dict) -> str:
    for fid in job["result_files"]:
        meta = gw.api("GET", f"/v1/files/{fid}", A).json()
        if meta["filename"].endswith("adapter.tar"):
            data = gw.api("GET", f"/v1/files/{fid}/content", A).content
            import io

            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                member = tar.extractfile(f"{job['id']}/adapter_model.safetensors")
                assert member is not None
                return hashlib.sha256(member.read()).hexdigest()
    raise AssertionError("no adapter.tar")


def test_gateway_killed_mid_job_then_restarted(cluster: None, tmp_path: Path) -> None:
    g = LiveGateway(tmp_path, ("t-life-k",))
    try:
        fid = g.upload("t-life-k", chat_file(tmp_path / "k.jsonl", 100, seed=5))
        job = g.create("t-life-k", fid, {**LONG_HP, "n_epochs": 2})
        g.wait("t-life-k", job["id"], lambda j: j["status"] == "running" or terminal(j), 120)
        g.kill9()
        time.sleep(3)
        g.start()
        done = g.wait("t-life-k", job["id"], terminal, 400)
        assert done["status"] == "succeeded", done["error"]
        assert len(done["result_files"]) == 3
    finally:
        g.stop()


def test_delete_fine_tuned_model_removes_its_files(succeeded: dict, gw: LiveGateway) -> None:
    job = succeeded["job"]
    jdir = STORAGE / "tenants" / A / "jobs" / job.id
    r = gw.api("DELETE", f"/v1/models/{job.fine_tuned_model}", A)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert not (jdir / "checkpoints").exists() and not (jdir / "attempts").exists()
    for fid in job.result_files:
        assert gw.api("GET", f"/v1/files/{fid}/content", A).status_code == 404
    assert job.fine_tuned_model not in [m["id"] for m in gw.api("GET", "/v1/models", A).json()["data"]]
    shutil.rmtree(jdir, ignore_errors=True)
