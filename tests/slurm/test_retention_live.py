"""Retention on the real cluster: files that expire go with the gateway's own sweeper (and a queued job's
file waits for that job's end), and a succeeded job keeps only the checkpoints it asked for, the freed
bytes reported exactly.

Two gateways: one whose leader sweeps every second (the expiry), one that sweeps only when the operator
says (``finetune admin sweep``), so the test can weigh the job's training state between its publication
and its prune."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.slurm import SlurmClient
from gateway.slurm.records import Owner
from gateway.storage import layout
from gateway.storage.layout import unix_user_for
from gateway.storage.onboarding import TenantAdmin
from tests.slurm.conftest import submit
from tests.slurm.livegateway import MODEL, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
EXPIRE, PRUNE = "t-expire", "t-prune"
FINETUNE = "/opt/slurm-finetune/venv/bin/finetune"
# 5 steps, a checkpoint and an eval at each, one checkpoint kept besides the best. min_delta above any
# loss change makes step 1's eval the best for good (patience > the evals left: no early stop), so the
# best is not the final one and both must stay.
PRUNE_HP = {"n_epochs": 1, "batch_size_tokens": 512, "max_seq_len": 256, "max_steps": 5,
            "checkpoint_every_steps": 1, "keep_checkpoints": 1, "eval_every_steps": 1,
            "early_stopping_patience": 10, "early_stopping_min_delta": 100.0, "learning_rate_multiplier": 10}


@pytest.fixture(scope="module")
def sweeping(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("expire"), (EXPIRE,), SFT_FILE_EXPIRY_MIN_S="1",
                    SFT_SWEEP_INTERVAL_S="1")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def manual(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("prune"), (PRUNE,), SFT_SWEEP_INTERVAL_S="3600")
    yield g
    g.stop()


def _dataset(tenant: str, sha256: str) -> Path:
    return layout.tenant_root(STORAGE, tenant).joinpath(*layout.dataset(sha256))


def _until(what: str, ok: Any, timeout: float = 30) -> float:
    t0 = time.monotonic()
    while not ok():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.2)
    return time.monotonic() - t0


def test_expired_files_go_and_a_queued_jobs_file_waits_for_its_end(sweeping: LiveGateway, admin: TenantAdmin,
                                                                    client: SlurmClient, tmp_path: Path) -> None:
    from openai import OpenAI

    g = sweeping
    openai = OpenAI(base_url=g.url + "/v1", api_key=g.tokens[EXPIRE], max_retries=0)
    # the tenant may hold one GPU, and a job of its own (outside the gateway) holds it: the gateway's job
    # queues (AssocGrpGRES) and never starts while the blocker runs
    admin.modify_tenant(EXPIRE, gpu_limit=1)
    blocker, _ = submit(client, EXPIRE, "sleep 300", minutes=5)
    owner = Owner(unix_user_for(EXPIRE), EXPIRE)
    try:
        _until("the blocker did not start", lambda: client.states([blocker])[blocker].state == "RUNNING")
        with open(chat_file(tmp_path / "a.jsonl", 40, seed=11), "rb") as f:
            gone = openai.files.create(file=f, purpose="fine-tune",
                                       expires_after={"anchor": "created_at", "seconds": 2})
        with open(chat_file(tmp_path / "b.jsonl", 40, seed=12), "rb") as f:     # time to create the job first
            used = openai.files.create(file=f, purpose="fine-tune",
                                       expires_after={"anchor": "created_at", "seconds": 5})
        assert gone.expires_at == gone.created_at + 2 and gone.status == "processed"
        job = g.create(EXPIRE, used.id)
        queued = g.wait(EXPIRE, job["id"], lambda j: j["status"] == "queued" or terminal(j), 60)
        assert queued["status"] == "queued", queued["error"]
        took = _until("the expired file is still there",
                      lambda: g.api("GET", f"/v1/files/{gone.id}", EXPIRE).status_code == 404)
        print(f"\nexpired file deleted {took:.1f}s after it was seen (2 s expiry, sweeps every 1 s)")
        audit = g.api("GET", "/v1/audit", EXPIRE).json()["data"]
        (entry,) = [e for e in audit if e["action"] == "file.expire" and e["resource"] == gone.id]
        assert entry["actor"] == "retention sweeper" and "bytes freed" in entry["reason"], entry
        # the queued job's file stays, while the job waits (more sweeps run meanwhile)
        time.sleep(3)
        assert g.job(EXPIRE, job["id"])["status"] == "queued"
        r = g.api("GET", f"/v1/files/{used.id}/content", EXPIRE)
        assert r.status_code == 200 and r.content == (tmp_path / "b.jsonl").read_bytes()
        r = g.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", EXPIRE)
        assert r.status_code == 200, r.text
        g.wait(EXPIRE, job["id"], terminal, 60)
        took = _until("the queued job's file outlived its job",
                      lambda: g.api("GET", f"/v1/files/{used.id}", EXPIRE).status_code == 404)
        print(f"the job's file deleted {took:.1f}s after the job ended")
    finally:
        client.cancel(blocker, owner=owner, deadline_s=10)
        admin.modify_tenant(EXPIRE, gpu_limit=-1)
    for path in ("a.jsonl", "b.jsonl"):       # the bytes left the tenant's storage
        assert not _dataset(EXPIRE, hashlib.sha256((tmp_path / path).read_bytes()).hexdigest()).exists(), path


def _bytes(paths: list[Path]) -> int:
    total = 0
    for top in paths:
        for dirpath, _, files in os.walk(top):
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
    return total


def test_a_succeeded_job_keeps_the_final_and_best_checkpoints_and_reports_the_freed_bytes(
        manual: LiveGateway, tmp_path: Path) -> None:
    g = manual
    file_id = g.upload(PRUNE, chat_file(tmp_path / "train.jsonl", 120, seed=5))
    job = g.create(PRUNE, file_id, PRUNE_HP)
    done = g.wait(PRUNE, job["id"], terminal, 240)
    assert done["status"] == "succeeded", done["error"]
    root = layout.tenant_root(STORAGE, PRUNE)
    state = [root.joinpath(*p) for p in layout.training_state(job["id"])]
    ckpts = state[0]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1", "step-5"], "the trainer kept the final and the best"
    pruned = done["progress"]["checkpoints_pruned"]
    assert pruned["steps"] == [2, 3, 4] and pruned["bytes"] > 0, pruned
    one = _bytes([ckpts / "step-5"])
    assert 2.5 * one < pruned["bytes"] < 3.5 * one, (pruned, one)     # three checkpoints like step 5's
    results = g.api("GET", f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", PRUNE).json()["data"]
    assert {c["step_number"] for c in results if c["adapter_file"]} == {1, 5}
    on_disk = _bytes(state)
    assert on_disk > 0 and "storage" not in done["progress"], "not pruned before the sweep"
    r = subprocess.run([FINETUNE, "admin", "sweep", "--json"], env=g.env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["deleted"].get("prune") == 1 and report["freed_bytes"] == on_disk, report
    assert not any(p.exists() for p in state), "checkpoint dirs, optimizer state, staging: all gone"
    after = g.job(PRUNE, job["id"])
    rec = after["progress"]["storage"]
    assert rec["kept_steps"] == [1, 5] and rec["removed_steps"] == [2, 3, 4] and rec["freed_bytes"] == on_disk, rec
    events = g.api("GET", f"/v1/fine_tuning/jobs/{job['id']}/events", PRUNE, params={"limit": 100}).json()["data"]
    (ev,) = [e for e in events if "kept_steps" in (e["data"] or {})]
    assert ev["data"]["freed_bytes"] == on_disk and ev["data"]["trainer_pruned_bytes"] == pruned["bytes"], ev
    print(f"\npruned job: kept steps 1 and 5; the trainer freed {pruned['bytes']} B while training, the sweeper "
          f"{on_disk} B after publication")
    # the kept checkpoints are still models, their adapters in the published tars
    for step in (1, 5):
        model = f"{after['fine_tuned_model']}:ckpt-step-{step}"
        assert g.api("GET", f"/v1/models/{model}", PRUNE).status_code == 200, model
    assert g.api("GET", f"/v1/models/{after['fine_tuned_model']}:ckpt-step-3", PRUNE).status_code == 404
    shown = subprocess.run([FINETUNE, "jobs", "show", job["id"]], capture_output=True, text=True, timeout=60,
                           env={**g.env, "SFT_API_URL": g.url, "SFT_API_TOKEN": g.tokens[PRUNE]}, check=False)
    assert f"storage freed:    {on_disk} bytes (checkpoints kept: steps 1, 5)" in shown.stdout, shown.stdout
    assert MODEL in after["model"]
