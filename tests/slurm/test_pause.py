"""Pause and resume on the real cluster: a paused job checkpoints, leaves its GPU and stays held
in Slurm's queue; resumed, it continues from that checkpoint and succeeds."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.livegateway import STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
T = "t-pause"
HP = {"n_epochs": 6, "batch_size_tokens": 256, "max_seq_len": 256, "checkpoint_every_steps": 1000,
      "learning_rate_multiplier": 5}


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("pause"), (T,))
    yield g
    g.stop()


def _squeue(slurm_id: int) -> tuple[str, str, str]:
    out = subprocess.run(["squeue", "-h", "-j", str(slurm_id), "-o", "%T|%r|%b"], capture_output=True,
                         text=True, check=False).stdout.strip()
    state, reason, gres = (out.split("|") + ["", "", ""])[:3]
    return state, reason, gres


def _trainers(user: str) -> list[str]:
    return subprocess.run(["pgrep", "-u", user, "-f", "trainer run"], capture_output=True, text=True,
                          check=False).stdout.split()


def _trainer_events(job_id: str) -> list[dict]:
    path = STORAGE / "tenants" / T / "jobs" / job_id / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_pause_releases_the_gpu_and_resume_continues_from_the_checkpoint(gw: LiveGateway, tmp_path: Path) -> None:
    file_id = gw.upload(T, chat_file(tmp_path / "train.jsonl", 200, seed=41))
    job = gw.create(T, file_id, HP)
    running = gw.wait(T, job["id"], lambda j: (j["progress"].get("step") or 0) >= 3 or terminal(j), 240)
    assert running["status"] == "running", running
    slurm_id = running["slurm_job_id"]
    t0 = time.monotonic()
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/pause", T)
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    deadline = time.monotonic() + 60
    while (view := _squeue(slurm_id))[0] != "PENDING" or _trainers(f"sft-{T}"):
        assert time.monotonic() < deadline, (view, _trainers(f"sft-{T}"))
        time.sleep(0.5)
    left = time.monotonic() - t0
    stopped = [e for e in _trainer_events(job["id"]) if e["type"] == "stopped"]
    print(f"\npause at step >= 3: the GPU was free {left:.1f}s later (squeue {view}); the trainer stopped at "
          f"step {stopped[-1]['step']} with checkpoint {stopped[-1]['checkpoint_step']}")
    assert stopped and stopped[-1]["signal"] == "SIGUSR1" and stopped[-1]["checkpoint_step"] >= 3
    assert "Held" in view[1], view                           # held: JobHeldAdmin, not merely waiting
    time.sleep(12)                                            # a few reconcile and scheduling cycles
    assert _squeue(slurm_id)[0] == "PENDING" and not _trainers(f"sft-{T}")
    assert gw.job(T, job["id"])["status"] == "paused"
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/pause", T)
    assert r.status_code == 200 and r.json()["status"] == "paused"        # idempotent
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/resume", T)
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    done = gw.wait(T, job["id"], terminal, 400)
    assert done["status"] == "succeeded", done["error"]
    resumed = [e.get("resumed_from_step") for e in _trainer_events(job["id"]) if e["type"] == "start"]
    print(f"resumed: start events {resumed}; attempt {done['attempt']}")
    assert stopped[-1]["checkpoint_step"] in resumed and done["attempt"] >= 1
    messages = [e["message"] for e in gw.api("GET", f"/v1/fine_tuning/jobs/{job['id']}/events",
                                               T, params={"limit": 1000}).json()["data"]]
    assert any(m.startswith("Pause requested") for m in messages) and any(m.startswith("Resumed") for m in messages)
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/pause", T)
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
