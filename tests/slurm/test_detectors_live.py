"""The stall detector on the real cluster: a running job's trainer is SIGSTOPped (as when its node's
slurmd restarted and its processes died or hung, while Slurm keeps it RUNNING). The gateway warns,
then requeues it; the next attempt resumes from the newest checkpoint and the job succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.livegateway import FAST_HP, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
T = "t-stall"


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("stall"), (T,), SFT_STALL_MIN_S="6", SFT_STALL_REQUEUE_S="6")
    yield g
    g.stop()


def _trainer_pid(job_id: str) -> int | None:
    spec = STORAGE / "tenants" / T / "jobs" / job_id / "spec.json"
    res = subprocess.run(["pgrep", "-f", f"trainer run {spec}"], capture_output=True, text=True)
    pids = [int(p) for p in res.stdout.split()]
    return pids[0] if pids else None


def test_a_stopped_trainer_is_detected_then_requeued_and_resumes(gw: LiveGateway, tmp_path: Path) -> None:
    fid = gw.upload(T, chat_file(tmp_path / "big.jsonl", 500, seed=71))    # ~60 steps: the stop comes at 6
    job = gw.create(T, fid, {**FAST_HP, "checkpoint_every_steps": 4})
    running = gw.wait(T, job["id"], lambda j: terminal(j) or (j.get("progress") or {}).get("step", 0) >= 6, 180)
    assert running["status"] == "running", running
    pid = _trainer_pid(job["id"])
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    print(f"\nSIGSTOP to the trainer (pid {pid}) at step {running['progress']['step']}")
    done = gw.wait(T, job["id"], terminal, 300)
    msgs = [(e["level"], e["message"]) for e in
            gw.api("GET", f"/v1/fine_tuning/jobs/{job['id']}/events?limit=1000", T).json()["data"]]
    detected = [m for lvl, m in msgs if m.startswith("Detector ")]
    print("\n".join(detected), f"\nended {done['status']} after {time.monotonic() - stopped_at:.0f} s, "
          f"attempt {done['attempt']}")
    assert done["status"] == "succeeded", done["error"]
    assert any(m.startswith("Detector stall: no step") for m in detected)
    assert any(m.startswith("Detector stall_requeue:") for m in detected)
    assert all(lvl == "warn" for lvl, m in msgs if m.startswith("Detector "))
    assert done["attempt"] >= 1
    # the resumed attempt continued from a checkpoint, not from step 0
    first = [e for e in _events(job["id"]) if e.get("type") == "metrics" and e.get("attempt") == 1]
    assert first and first[0]["step"] > 1, first[:1]


def _events(job_id: str) -> list[dict[str, object]]:
    return _events_of(T, job_id)


@pytest.fixture(scope="module")
def diverging_gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    fault = {"SFT_TEST_TIER": "1", "SFT_TEST_FAULT_LR_BLOWUP_AT_STEP": "3"}   # into every job's environment
    g = LiveGateway(tmp_path_factory.mktemp("nan"), (T_NAN,), SFT_TEST_JOB_ENV=json.dumps(fault))
    yield g
    g.stop()


T_NAN = "t-nan"


def test_a_job_whose_loss_goes_nan_fails_fast_with_a_clear_error(diverging_gw: LiveGateway, tmp_path: Path) -> None:
    """The test-only learning-rate blow-up at step 3: step 4's loss is not finite, and the job fails
    there as the tenant's error (not a node fault, not requeued)."""
    gw = diverging_gw
    fid = gw.upload(T_NAN, chat_file(tmp_path / "nan.jsonl", 200, seed=72))
    job = gw.create(T_NAN, fid, FAST_HP)
    done = gw.wait(T_NAN, job["id"], terminal, 300)
    print(f"\n{done['status']}: {done['error']}")
    assert done["status"] == "failed" and done["attempt"] == 0, done
    assert done["error"]["code"] == "user_error", done["error"]      # exit 65, read from sacct
    assert "training diverged at step 4" in done["error"]["message"], done["error"]
    assert "lower the learning rate" in done["error"]["message"] and "Traceback" not in done["error"]["message"]
    steps = [e["step"] for e in _events_of(T_NAN, job["id"]) if e.get("type") == "metrics"]
    assert steps == [1, 2, 3] and not done["result_files"], steps


def _events_of(tenant: str, job_id: str) -> list[dict[str, object]]:
    import json

    path = STORAGE / "tenants" / tenant / "jobs" / job_id / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
