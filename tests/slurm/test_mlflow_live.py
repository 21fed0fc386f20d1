"""MLflow on the real cluster, one real job for both promises: the gateway (not the job) logs the run to a
real ``mlflow server`` (loopback, allowed by this gateway's settings), and the run's metric history is the
job's events point for point; the server is stopped while the job trains, the job still succeeds, and once
the server is back the gateway logs everything it missed and completes the run (FINISHED). Read back with
MLflow's own client, from its venv. A sweep's parent and child runs are checked against the same server
(rows made in a database of the test's own, logged by ``log_due`` in-process: no second training)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session, select

from gateway.config import Settings
from gateway.db import make_engine, migrate
from gateway.models import DataFile, FineTuningJob, JobEvent, MlflowParentRun, MlflowRun, Sweep, Tenant, utcnow
from gateway.services import mlflowlog, tracking
from gateway.services.jobwrites import add_event
from gateway.state import JobState, TrackingState
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

    # the run and its params reach MLflow as the job starts; then the server goes away for the training
    _until("run created", lambda: _row(gw, job["id"]).params_logged, 180)
    server.stop()
    stopped = time.monotonic()
    at_stop = gw.job(T, job["id"])
    assert not terminal(at_stop), "the job ended before the server was stopped: nothing was shown"
    logged_before = _row(gw, job["id"]).event_cursor
    done = gw.wait(T, job["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    row = _row(gw, job["id"])
    assert row.status == TrackingState.LOGGING and row.attempts > 0 and row.event_cursor == logged_before, row
    print(f"server stopped while the job was {at_stop['status']} ({at_stop['phase']}); "
          f"job succeeded with the server down ({time.monotonic() - stopped:.1f}s after the stop, "
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
    evals = [e for e in events if "valid_loss" in (e.data or {}) and e.data.get("when") != "after"]
    final = [e for e in events if "valid_loss" in (e.data or {}) and e.data.get("when") == "after"]
    rid = str(_row(gw, job["id"]).run_id)
    run = server.read_runs([rid], ["train_loss", "lr", "valid_loss", "final_valid_loss"])[rid]
    for key in ("train_loss", "lr"):      # step, value and time of each point: the step events'
        assert run["metrics"][key] == [[e.data["step"], e.data[key], int(e.created_at.timestamp() * 1000)]
                                       for e in steps], key
    assert [(s, v) for s, v, _ in run["metrics"]["valid_loss"]] == [(e.data["step"], e.data["valid_loss"])
                                                                    for e in evals]
    assert [(s, v) for s, v, _ in run["metrics"]["final_valid_loss"]] == [(e.data["step"], e.data["valid_loss"])
                                                                          for e in final] and len(final) == 1
    assert len(evals) >= 2
    assert logged_before < events[-1].id, "every point was logged before the outage: nothing was caught up"
    assert run["status"] == "FINISHED" and run["end_time"] and run["run_name"] == "tiny-live"
    assert run["experiment"] == "issue-34" and run["params"]["job_id"] == job["id"]
    assert run["params"]["hp.eval_every_steps"] == "4" and run["params"]["validation_file"] == val
    assert run["tags"]["slurm_finetune.job_id"] == job["id"]
    assert run["tags"]["slurm_finetune.url"] == f"https://finetune.example.org/portal/jobs/{job['id']}"
    print(f"run has {len(steps)} train_loss and lr points equal to the {len(steps)} step events "
          f"({sum(1 for e in steps if (e.id or 0) > logged_before)} of them logged after the outage), "
          f"{len(evals)} valid_loss points equal to the eval events, final_valid_loss the final eval's")


def test_a_sweep_is_a_parent_run_with_a_child_run_per_job_on_a_real_server(server: MlflowServer,
                                                                            tmp_path: Path) -> None:
    server.wait_up()
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'g.db'}", mlflow_allowed_hosts=["127.0.0.1"],
                        integration_key_file=tmp_path / "integrations.key")
    engine = make_engine(settings.database_url)
    migrate(engine)
    its = tracking.parse([{"type": "mlflow", "mlflow": {"tracking_uri": server.url, "experiment": "issue-34-sweep",
                                                        "run_name": "grid"}}], settings)
    with Session(engine) as s:
        s.add(Tenant(id=1, name="acme", unix_user="sft-acme"))
        s.flush()
        s.add(DataFile(id="file-1", tenant_id=1, filename="t", bytes=1, sha256="0" * 64, status="processed"))
        sweep = Sweep(tenant_id=1, model="tiny-chat", grid={"learning_rate": [1e-4, 1e-3]}, job_ids=[])
        jobs = [FineTuningJob(tenant_id=1, training_file="file-1", model="tiny-chat", sweep_id=sweep.id,
                              status=JobState.SUCCEEDED.value, finished_at=utcnow(),
                              hyperparameters={"learning_rate": lr},
                              progress={"evals": [{"when": "after", "step": 2, "loss": loss}]})
                 for lr, loss in ((1e-4, 2.5), (1e-3, 2.0))]
        sweep.job_ids = [j.id for j in jobs]
        s.add(sweep)
        s.flush()
        for j in jobs:
            s.add(j)
            s.flush()
            for step in (1, 2):
                add_event(s, j.id, "step", type_="metrics", data={"step": step, "train_loss": 3.0 / step})
        tracking.attach_sweep(s, sweep, jobs, its, settings)
        s.commit()
        sweep_id, job_ids = sweep.id, sweep.job_ids
    assert mlflowlog.log_due(engine, settings) == 3             # two children, then their parent
    with Session(engine) as s:
        parent_row = s.get(MlflowParentRun, sweep_id)
        child_ids = [str(r.run_id) for j in job_ids if (r := s.get(MlflowRun, j)) is not None]
    assert parent_row is not None and parent_row.run_id and len(child_ids) == 2
    runs = server.read_runs([parent_row.run_id, *child_ids], ["best_valid_loss", "train_loss"])
    parent = runs[parent_row.run_id]
    assert parent["status"] == "FINISHED" and parent["run_name"] == "grid" and parent["params"]["runs"] == "2"
    assert parent["tags"]["slurm_finetune.sweep_id"] == sweep_id and parent["metrics"]["best_valid_loss"][0][1] == 2.0
    for task, (rid, job_id) in enumerate(zip(child_ids, job_ids, strict=True)):
        child = runs[rid]
        assert child["tags"]["mlflow.parentRunId"] == parent_row.run_id and child["run_name"] == f"grid-{task}"
        assert child["params"]["job_id"] == job_id and child["status"] == "FINISHED"
        assert [(st, v) for st, v, _ in child["metrics"]["train_loss"]] == [(1, 3.0), (2, 1.5)]
    engine.dispose()
