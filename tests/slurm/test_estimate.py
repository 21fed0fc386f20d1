"""Start estimates on the real cluster: a dry run (API and CLI) says what a job would take and when
it would start: now on an idle cluster; later, naming the QOS limit, while the tenant's QOS tier is
full (Slurm's own --test-only ignores QOS limits: the gateway checks them first). A queued job keeps
Slurm's planned start (squeue --start). Nothing of a dry run is recorded or submitted."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.livegateway import FAST_HP, MODEL, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
T = "t-estimate"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("estimate"), (T,))
    yield g
    g.stop()


def _estimate(gw: LiveGateway, fid: str) -> dict[str, Any]:
    r = gw.api("POST", "/v1/fine_tuning/jobs/estimate", T, json={"model": MODEL, "training_file": fid,
                                                                   "hyperparameters": FAST_HP})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_now_when_idle_later_with_the_reason_when_the_qos_is_full(gw: LiveGateway, tmp_path: Path) -> None:
    small = gw.upload(T, chat_file(tmp_path / "s.jsonl", 40, seed=81))
    big = gw.upload(T, chat_file(tmp_path / "b.jsonl", 3000, seed=82))
    idle = _estimate(gw, small)
    print(f"\nidle: {idle}")
    assert idle["qos"] == "ft-small" and idle["start_reason"] is None
    assert abs(idle["expected_start"] - time.time()) < 10
    assert idle["estimated_tokens"] > 0 and idle["gpu_hours"] > 0 and idle["time_limit_minutes"] >= 5
    assert gw.api("GET", "/v1/fine_tuning/jobs", T).json()["data"] == []          # nothing recorded
    env = {**gw.env, "SFT_API_URL": gw.url, "SFT_API_TOKEN": gw.tokens[T]}
    res = subprocess.run([sys.executable, "-m", "gateway", "jobs", "estimate", "--training-file", small,
                          "--model", MODEL, "--epochs", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "expected start: now" in res.stdout, res.stdout + res.stderr

    runner = gw.create(T, big, {**FAST_HP, "n_epochs": 3})           # ft-small allows 1 GPU per user
    gw.wait(T, runner["id"], lambda j: j["status"] == "running" or terminal(j), 120)
    full = _estimate(gw, small)
    print(f"QOS full: {full}")
    assert full["start_reason"] == "QOSMaxGRESPerUser" and "ft-small" in full["start_detail"]
    assert full["expected_start"] is not None and full["expected_start"] > time.time() + 30
    # a job queued behind it keeps Slurm's plan for its start, as squeue --start says it
    queued = gw.create(T, small, FAST_HP)
    time.sleep(3)
    job = gw.job(T, queued["id"])
    planned = subprocess.run(["squeue", "--noheader", "--start", f"--jobs={queued['slurm_job_id']}", "--format=%S"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    print(f"queued job: status {job['status']}, expected_start {job['expected_start']}, squeue --start {planned!r}")
    if job["status"] == "queued" and planned not in ("", "N/A"):
        from gateway.slurm.records import opt_time

        when = opt_time(planned)
        assert when is not None and job["expected_start"] is not None
        assert abs(job["expected_start"] - when.timestamp()) <= 60
    for j in (runner, queued):
        gw.api("POST", f"/v1/fine_tuning/jobs/{j['id']}/cancel", T)
    for j in (runner, queued):
        gw.wait(T, j["id"], terminal, 120)
