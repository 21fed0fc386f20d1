"""MLflow on the real cluster, one real job for both promises: the gateway (not the job) logs the run to a
real ``mlflow server`` (loopback, allowed by this gateway's settings), and the run's metric history is the
job's events point for point; the server is stopped while the job trains, the job still succeeds, and once
the server is back the gateway logs everything it missed and completes the run (FINISHED). Read back with
MLflow's own client, from its venv."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session, select

from gateway.models import JobEvent, MlflowRun
from gateway.state import TrackingState
from tests.mlflow_server import MlflowServer
from tests.slurm.livegateway import FAST_HP, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
T = "t-mlflow"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()                       # ~8 s: it comes up while the gateway onboards its tenant
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gw(cluster: None, server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    work = tmp_path_factory.mktemp("mlgw")
    g = LiveGateway(work, (T,), SFT_MLFLOW_ALLOWED_HOSTS='["127.0.0.1"]', SFT_MLFLOW_RETRY_BASE_S="0.5",
                    SFT_MLFLOW_MAX_BACKOFF_S="2", SFT_PUBLIC_URLS='["https://finetune.example.org"]')
    yield g
    g.stop()


def _row(gw: LiveGateway, job_id: str) -> MlflowRun:
    with Session(gw.engine) as s:
        row = s.get(MlflowRun, job_id)
        assert row is not None
        return row


def _first_step(gw: LiveGateway, job_id: str) -> int:
    """The id of the job's first step event, 0 before there is one."""
    with Session(gw.engine) as s:
        for ev in s.exec(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                         .order_by(JobEvent.id)):      # type: ignore[arg-type]
            if "train_loss" in (ev.data or {}):
                return int(ev.id or 0)
    return 0


def _until(what: str, ok: object, timeout: float) -> float:
    t0 = time.monotonic()
    while not ok():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, f"{what}: not after {timeout}s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_job_logs_its_loss_curve_point_for_point_through_a_tracking_server_outage(
        gw: LiveGateway, server: MlflowServer, tmp_path: Path) -> None:
    print(f"\nmlflow server up {server.wait_up():.1f}s after its start")
    train = gw.upload(T, chat_file(tmp_path / "t.jsonl", 80, seed=34))
    val = gw.upload(T, chat_file(tmp_path / "v.jsonl", 12, seed=35))
    integration = {"type": "mlflow", "mlflow": {"tracking_uri": server.url, "experiment": "issue-34",
                                                "run_name": "tiny-live", "token": "not-shown-anywhere"}}
    job = gw.create(T, train, {**FAST_HP, "eval_every_steps": 4}, validation_file=val, integrations=[integration])
    assert job["integrations"][0]["mlflow"]["auth"] == "token" and "not-shown-anywhere" not in str(job)

    # the first training steps reach MLflow while the job trains; then the server goes away
    _until("first step logged", lambda: 0 < _first_step(gw, job["id"]) <= _row(gw, job["id"]).event_cursor, 180)
    server.stop()
    stopped = time.monotonic()
    logged_before = _row(gw, job["id"]).event_cursor
    done = gw.wait(T, job["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    row = _row(gw, job["id"])
    assert row.status == TrackingState.LOGGING and row.attempts > 0 and row.event_cursor == logged_before, row
    print(f"job succeeded with the server down ({time.monotonic() - stopped:.1f}s after the stop, "
          f"{row.attempts} failed attempts, last: {row.last_error})")
    server.start()
    print(f"mlflow server back after {time.monotonic() - stopped:.1f}s down, up in {server.wait_up():.1f}s")
    back = time.monotonic()
    _until("run completed", lambda: _row(gw, job["id"]).status == TrackingState.DONE, 60)
    print(f"run completed {time.monotonic() - back:.1f}s after the server answered again")

    with Session(gw.engine) as s:
        events = list(s.exec(select(JobEvent).where(JobEvent.job_id == job["id"], JobEvent.type == "metrics")
                             .order_by(JobEvent.id)))     # type: ignore[arg-type]
    steps = [e for e in events if "train_loss" in (e.data or {})]
    evals = [e for e in events if "valid_loss" in (e.data or {})]
    run = server.read_run(str(_row(gw, job["id"]).run_id), ["train_loss", "lr", "valid_loss", "final_valid_loss"])
    for key in ("train_loss", "lr"):      # step, value and time of each point: the step events'
        assert run["metrics"][key] == [[e.data["step"], e.data[key], int(e.created_at.timestamp() * 1000)]
                                       for e in steps], key
    assert [(s, v) for s, v, _ in run["metrics"]["valid_loss"]] == [(e.data["step"], e.data["valid_loss"])
                                                                    for e in evals]
    assert len(run["metrics"]["final_valid_loss"]) == 1 and len(evals) >= 2
    assert logged_before < events[-1].id, "every point was logged before the outage: nothing was caught up"
    assert run["status"] == "FINISHED" and run["end_time"] and run["run_name"] == "tiny-live"
    assert run["experiment"] == "issue-34" and run["params"]["job_id"] == job["id"]
    assert run["params"]["hp.eval_every_steps"] == "4" and run["params"]["validation_file"] == val
    assert run["tags"]["slurm_finetune.job_id"] == job["id"]
    assert run["tags"]["slurm_finetune.url"] == f"https://finetune.example.org/portal/jobs/{job['id']}"
    print(f"run has {len(steps)} train_loss and lr points equal to the {len(steps)} step events "
          f"({sum(1 for e in steps if (e.id or 0) > logged_before)} of them logged after the outage), "
          f"{len(evals)} valid_loss points equal to the eval events")
