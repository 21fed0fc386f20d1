"""The MLflow integration's logic against an in-memory MLflow REST fake (httpx.MockTransport) and a real
SQLite file: the checks at create (refusals name ``integrations[i]...``), credentials sealed and never shown,
the run's params and metric history point for point from the job's events, the cursor, the back-off while
the server is down and the catch-up once it is back, the end status. The real MLflow server runs in the
slurm tier (tests/slurm/test_mlflow_live.py)."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from gateway.config import Settings
from gateway.db import make_engine, migrate
from gateway.errors import ServiceError
from gateway.models import DataFile, FineTuningJob, JobEvent, MlflowParentRun, MlflowRun, Sweep, Tenant, utcnow
from gateway.services import mlflowlog, tracking
from gateway.services.jobwrites import add_event
from gateway.state import JobState, MlflowRunStatus, TrackingState

URI = "http://93.184.215.14:5000"     # a public address, literal: no DNS in a unit test


class FakeMlflow:
    """The REST calls the gateway makes, answered as MLflow does; ``down`` refuses every connection."""

    def __init__(self) -> None:
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.down = False
        self.calls: list[str] = []
        self.auth: list[str | None] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path.removeprefix("/api/2.0/mlflow/")
        self.calls.append(path)
        self.auth.append(request.headers.get("authorization"))
        body = json.loads(request.content) if request.content else {}
        if path == "experiments/get-by-name":
            name = request.url.params["experiment_name"]
            if name not in self.experiments:
                return httpx.Response(404, json={"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"})
            return httpx.Response(200, json={"experiment": {"experiment_id": self.experiments[name]}})
        if path == "experiments/create":
            self.experiments[body["name"]] = str(len(self.experiments) + 1)
            return httpx.Response(200, json={"experiment_id": self.experiments[body["name"]]})
        if path == "runs/create":
            rid = f"run{len(self.runs)}"
            self.runs[rid] = {**body, "status": "RUNNING", "params": {}, "metrics": {}, "tags": {
                t["key"]: t["value"] for t in body.get("tags", [])}}
            return httpx.Response(200, json={"run": {"info": {"run_id": rid}}})
        run = self.runs[body["run_id"]]
        if path == "runs/log-batch":
            run["params"].update({p["key"]: p["value"] for p in body["params"]})
            run["tags"].update({t["key"]: t["value"] for t in body["tags"]})
            for m in body["metrics"]:
                run["metrics"].setdefault(m["key"], []).append((m["step"], m["value"], m["timestamp"]))
            return httpx.Response(200, json={})
        if path == "runs/update":
            run["status"], run["end_time"] = body["status"], body.get("end_time")
            return httpx.Response(200, json={})
        return httpx.Response(404, json={"error_code": "ENDPOINT_NOT_FOUND", "message": path})


@pytest.fixture
def env(tmp_path: Path) -> tuple[Any, Settings, FakeMlflow]:
    settings = Settings(storage_root=tmp_path / "s", database_url=f"sqlite:///{tmp_path / 'g.db'}",
                        integration_key_file=tmp_path / "state" / "integrations.key", mlflow_retry_base_s=2,
                        mlflow_max_backoff_s=30, mlflow_max_attempts=5, public_urls=["https://ft.example.org"])
    engine = make_engine(settings.database_url)
    migrate(engine)
    with Session(engine) as s:
        s.add(Tenant(id=1, name="acme", unix_user="sft-acme"))
        s.commit()
        s.add(DataFile(id="file-1", tenant_id=1, filename="t", bytes=1, sha256="0" * 64, status="processed"))
        s.commit()
    return engine, settings, FakeMlflow()


def _job(engine: Any, settings: Settings, entry: dict[str, Any], **kw: Any) -> str:
    its = tracking.parse([{"type": "mlflow", "mlflow": entry}], settings)
    with Session(engine) as s:
        job = FineTuningJob(tenant_id=1, training_file="file-1", model="tiny-chat", status=JobState.RUNNING.value,
                            hyperparameters={"n_epochs": 2, "learning_rate": 1e-3}, slurm_job_id=7,
                            integrations=[it.public() for it in its], **kw)
        s.add(job)
        s.flush()
        tracking.attach(s, job, its, settings)
        s.commit()
        return job.id


def _steps(engine: Any, job_id: str, steps: range, *, evals: bool = False) -> None:
    with Session(engine) as s:
        for n in steps:
            add_event(s, job_id, f"Step {n}", type_="metrics",
                      data={"step": n, "total_steps": 9, "train_loss": 3.0 - n / 10, "lr": 1e-4 * n,
                            "tokens_per_s": 100.0 + n})
            if evals and n % 3 == 0:
                add_event(s, job_id, f"Eval {n}", type_="metrics", data={
                    "step": n, "when": "step", "valid_loss": 2.5 - n / 10, "valid_mean_token_accuracy": None})
        add_event(s, job_id, "Checkpoint saved")        # not a metrics event: not logged
        s.commit()


def _end(engine: Any, job_id: str, state: JobState) -> None:
    with Session(engine) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        job.status, job.finished_at, job.trained_tokens = state.value, utcnow(), 4096
        job.progress = {"step": 9, "evals": [{"when": "before", "step": 0, "loss": 3.1},
                                             {"when": "after", "step": 9, "loss": 1.5, "perplexity": 4.48}]}
        s.add(job)
        # the final eval often repeats the last step's in the same millisecond: MLflow would keep one of the two
        add_event(s, job_id, "Eval (step)", type_="metrics", data={"step": 9, "when": "step", "valid_loss": 1.5})
        add_event(s, job_id, "Eval (after)", type_="metrics", data={"step": 9, "when": "after", "valid_loss": 1.5})
        s.commit()


def _row(engine: Any, job_id: str) -> MlflowRun:
    with Session(engine) as s:
        row = s.get(MlflowRun, job_id)
        assert row is not None
        return row


def _log(engine: Any, settings: Settings, fake: FakeMlflow) -> int:
    return mlflowlog.log_due(engine, settings, transport=httpx.MockTransport(fake.handle))


def _due_now(engine: Any, job_id: str) -> None:
    with Session(engine) as s:
        row = s.get(MlflowRun, job_id)
        assert row is not None
        row.next_at = utcnow() - timedelta(seconds=1)
        s.add(row)
        s.commit()


# ------------------------------------------------------------------ checks at create
@pytest.mark.parametrize(("entry", "param"), [
    ({"type": "wandb", "wandb": {"project": "x"}}, "integrations[0].type"),
    ({"type": "mlflow"}, "integrations[0].mlflow"),
    ({"type": "mlflow", "mlflow": {"experiment": "e"}}, "integrations[0].mlflow.tracking_uri"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": URI}}, "integrations[0].mlflow.experiment"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": "ftp://93.184.215.14", "experiment": "e"}},
     "integrations[0].mlflow.tracking_uri"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": "http://u:p@93.184.215.14", "experiment": "e"}},
     "integrations[0].mlflow.tracking_uri"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "e", "tokn": "x"}},
     "integrations[0].mlflow.tokn"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "e", "token": "t", "username": "u",
                                   "password": "p"}}, "integrations[0].mlflow.token"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "e", "username": "u"}},
     "integrations[0].mlflow.token"),
])
def test_a_wrong_integration_is_refused_naming_its_field(env: Any, entry: dict[str, Any], param: str) -> None:
    _, settings, _ = env
    with pytest.raises(ServiceError) as e:
        tracking.parse([entry], settings)
    assert e.value.param == param and e.value.status == 400, e.value.message


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "http://10.1.2.3", "http://[::1]:5000",
                                 "http://169.254.169.254/latest", "http://[64:ff9b::7f00:1]"])
def test_internal_tracking_servers_are_refused_unless_the_site_allows_the_host(env: Any, uri: str) -> None:
    _, settings, _ = env
    entry = {"type": "mlflow", "mlflow": {"tracking_uri": uri, "experiment": "e"}}
    with pytest.raises(ServiceError) as e:
        tracking.parse([entry], settings)
    assert e.value.param == "integrations[0].mlflow.tracking_uri"
    assert "not a public address" in e.value.message
    host = httpx.URL(uri).host
    assert tracking.parse([entry], settings.model_copy(update={"mlflow_allowed_hosts": [host]}))


def test_credentials_are_sealed_never_shown_and_never_hashed(env: Any, tmp_path: Path) -> None:
    engine, settings, fake = env
    secret = "tok-" + "s3cr3t" * 4
    job_id = _job(engine, settings, {"tracking_uri": URI, "experiment": "e", "token": secret})
    with Session(engine) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None and job.integrations == [
            {"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "e", "run_name": None, "auth": "token"}}]
    db = b"".join(p.read_bytes() for p in tmp_path.glob("g.db*"))
    assert secret.encode() not in db and _row(engine, job_id).credentials
    assert settings.integration_key_file.stat().st_mode & 0o777 == 0o600
    raw = [{"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "e", "token": secret}}]
    assert secret not in json.dumps(tracking.redacted(raw))
    _log(engine, settings, fake)
    assert set(fake.auth) == {f"Bearer {secret}"}


def test_basic_credentials_go_as_basic_auth(env: Any) -> None:
    engine, settings, fake = env
    _job(engine, settings, {"tracking_uri": URI, "experiment": "e", "username": "ann", "password": "pw"})
    _log(engine, settings, fake)
    assert set(fake.auth) == {"Basic " + base64.b64encode(b"ann:pw").decode()}


# ------------------------------------------------------------------ logging
def test_the_run_gets_params_tags_and_every_metric_point_then_the_end_status(env: Any) -> None:
    engine, settings, fake = env
    job_id = _job(engine, settings, {"tracking_uri": URI, "experiment": "exp", "run_name": "first"})
    _steps(engine, job_id, range(1, 6), evals=True)
    assert _log(engine, settings, fake) == 0          # the job still runs: the run stays open
    (rid, run), = fake.runs.items()
    assert run["run_name"] == "first" and run["tags"]["slurm_finetune.job_id"] == job_id
    assert run["tags"]["slurm_finetune.url"] == f"https://ft.example.org/portal/jobs/{job_id}"
    assert run["params"]["job_id"] == job_id and run["params"]["model"] == "tiny-chat"
    assert run["params"]["hp.learning_rate"] == "0.001" and run["params"]["training_file"] == "file-1"
    assert [(s, v) for s, v, _ in run["metrics"]["train_loss"]] == [(n, 3.0 - n / 10) for n in range(1, 6)]
    assert [s for s, _, _ in run["metrics"]["lr"]] == [1, 2, 3, 4, 5]
    assert [(s, v) for s, v, _ in run["metrics"]["valid_loss"]] == [(3, 2.5 - 0.3)]
    assert "valid_mean_token_accuracy" not in run["metrics"] and run["status"] == "RUNNING"
    calls = len(fake.calls)
    assert _log(engine, settings, fake) == 0 and len(fake.calls) == calls   # nothing new: no call at all
    _steps(engine, job_id, range(6, 10))
    _end(engine, job_id, JobState.SUCCEEDED)
    assert _log(engine, settings, fake) == 1
    with Session(engine) as s:
        events = s.exec(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics",
                                               JobEvent.message.startswith("Step"))).all()   # type: ignore[attr-defined]
    assert [(s, v, t) for s, v, t in run["metrics"]["train_loss"]] == [
        (e.data["step"], e.data["train_loss"], int(e.created_at.timestamp() * 1000)) for e in events]
    assert run["status"] == "FINISHED" and run["end_time"] and run["tags"]["slurm_finetune.status"] == "succeeded"
    assert run["metrics"]["final_valid_loss"] == [(9, 1.5, run["metrics"]["final_valid_loss"][0][2])]
    assert [(s, v) for s, v, _ in run["metrics"]["valid_loss"]] == [(3, 2.5 - 0.3), (9, 1.5)]
    assert run["metrics"]["trained_tokens"][0][1] == 4096.0
    row = _row(engine, job_id)
    assert row.status == TrackingState.DONE and row.run_id == rid and row.experiment_id == fake.experiments["exp"]
    assert _log(engine, settings, fake) == 0 and fake.runs[rid]["status"] == "FINISHED"


@pytest.mark.parametrize(("state", "status"), [(JobState.FAILED, "FAILED"), (JobState.CANCELLED, "KILLED")])
def test_a_failed_or_cancelled_job_ends_its_run_so(env: Any, state: JobState, status: str) -> None:
    engine, settings, fake = env
    job_id = _job(engine, settings, {"tracking_uri": URI, "experiment": "exp"})
    _steps(engine, job_id, range(1, 3))
    _end(engine, job_id, state)
    assert _log(engine, settings, fake) == 1
    (run,) = fake.runs.values()
    assert run["status"] == status and len(run["metrics"]["train_loss"]) == 2


def test_two_jobs_share_an_experiment(env: Any) -> None:
    engine, settings, fake = env
    for _ in range(2):
        _job(engine, settings, {"tracking_uri": URI, "experiment": "shared"})
    _log(engine, settings, fake)
    assert list(fake.experiments) == ["shared"] and len(fake.runs) == 2
    assert {r["experiment_id"] for r in fake.runs.values()} == {fake.experiments["shared"]}


def test_a_server_that_is_down_backs_off_then_gets_the_whole_history(env: Any) -> None:
    engine, settings, fake = env
    job_id = _job(engine, settings, {"tracking_uri": URI, "experiment": "exp"})
    _steps(engine, job_id, range(1, 4))
    _log(engine, settings, fake)
    cursor = _row(engine, job_id).event_cursor
    fake.down = True
    _steps(engine, job_id, range(4, 10))
    _end(engine, job_id, JobState.SUCCEEDED)
    waits = []
    for n in range(1, 4):
        before = utcnow()
        assert _log(engine, settings, fake) == 0
        row = _row(engine, job_id)
        assert row.attempts == n and row.event_cursor == cursor and "ConnectError" in (row.last_error or "")
        waits.append(round((row.next_at - before).total_seconds()))
        assert _log(engine, settings, fake) == 0 and _row(engine, job_id).attempts == n   # not due yet: untried
        _due_now(engine, job_id)
    assert waits == [2, 4, 8]
    fake.down = False
    assert _log(engine, settings, fake) == 1
    (run,) = fake.runs.values()
    assert [s for s, _, _ in run["metrics"]["train_loss"]] == list(range(1, 10)) and run["status"] == "FINISHED"
    assert _row(engine, job_id).attempts == 0 and _row(engine, job_id).last_error is None


def test_a_run_is_given_up_after_the_most_attempts(env: Any) -> None:
    engine, settings, fake = env
    job_id = _job(engine, settings, {"tracking_uri": URI, "experiment": "exp"})
    fake.down = True
    for _ in range(settings.mlflow_max_attempts):
        _due_now(engine, job_id)
        _log(engine, settings, fake)
    row = _row(engine, job_id)
    assert row.status == TrackingState.FAILED and row.attempts == settings.mlflow_max_attempts and row.finished_at


def test_backoff_doubles_up_to_its_maximum(env: Any) -> None:
    _, settings, _ = env
    assert [mlflowlog.backoff_s(n, settings) for n in (1, 2, 3, 4, 5, 6, 50)] == [2, 4, 8, 16, 30, 30, 30]


def test_an_address_the_host_no_longer_allows_is_not_dialled(env: Any) -> None:
    engine, settings, fake = env
    job_id = _job(engine, settings, {"tracking_uri": URI, "experiment": "exp"})
    with Session(engine) as s:
        row = s.exec(select(MlflowRun)).one()
        row.tracking_uri = "http://127.0.0.1:5000"       # as if its DNS now answered loopback
        s.add(row)
        s.commit()
    assert mlflowlog.log_due(engine, settings) == 0           # the real (pinned) transport: refused before dialling
    row = _row(engine, job_id)
    assert row.attempts == 1 and "not a public address" in (row.last_error or "") and not fake.calls


# ------------------------------------------------------------------ sweeps: a parent run and its children
def _sweep(engine: Any, settings: Settings, n: int) -> tuple[str, list[str]]:
    its = tracking.parse([{"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "grid",
                                                        "run_name": "lr-grid", "token": "t"}}], settings)
    with Session(engine) as s:
        sweep = Sweep(tenant_id=1, model="tiny-chat", grid={"learning_rate": [1e-4, 1e-3][:n]}, job_ids=[])
        jobs = [FineTuningJob(tenant_id=1, training_file="file-1", model="tiny-chat", status=JobState.RUNNING.value,
                              sweep_id=sweep.id, hyperparameters={"learning_rate": lr})
                for lr in sweep.grid["learning_rate"]]
        sweep.job_ids = [j.id for j in jobs]
        s.add(sweep)
        s.flush()
        for j in jobs:
            s.add(j)
            s.flush()
        tracking.attach_sweep(s, sweep, jobs, its, settings)
        s.commit()
        return sweep.id, sweep.job_ids


def test_a_sweep_logs_one_parent_run_with_a_child_run_per_job(env: Any) -> None:
    engine, settings, fake = env
    sweep_id, job_ids = _sweep(engine, settings, 2)
    for job_id in job_ids:
        _steps(engine, job_id, range(1, 3))
    _log(engine, settings, fake)
    parent = next(r for r in fake.runs.values() if "slurm_finetune.sweep_id" in r["tags"])
    pid = next(k for k, r in fake.runs.items() if r is parent)
    children = [r for r in fake.runs.values() if r is not parent]
    assert len(fake.runs) == 3 and parent["run_name"] == "lr-grid" and parent["params"]["grid.learning_rate"]
    assert [c["run_name"] for c in children] == ["lr-grid-0", "lr-grid-1"]
    assert all(c["tags"]["mlflow.parentRunId"] == pid and c["experiment_id"] == parent["experiment_id"]
               for c in children)
    _end(engine, job_ids[0], JobState.SUCCEEDED)
    _log(engine, settings, fake)
    assert parent["status"] == "RUNNING"                # one child still runs
    _end(engine, job_ids[1], JobState.SUCCEEDED)
    _log(engine, settings, fake)
    assert parent["status"] == "FINISHED" and parent["metrics"]["best_valid_loss"][0][1] == 1.5
    assert [c["status"] for c in children] == ["FINISHED", "FINISHED"]
    with Session(engine) as s:
        row = s.get(MlflowParentRun, sweep_id)
        assert row is not None and row.status == TrackingState.DONE and row.run_id == pid


@pytest.mark.parametrize(("states", "status"), [
    (["succeeded", "succeeded"], MlflowRunStatus.FINISHED), (["succeeded", "cancelled"], MlflowRunStatus.KILLED),
    (["failed", "cancelled"], MlflowRunStatus.FAILED)])
def test_a_sweeps_parent_run_ends_as_its_runs_did(states: list[str], status: MlflowRunStatus) -> None:
    assert mlflowlog.sweep_status(states) == status


# ------------------------------------------------------------------ the tenant's server is untrusted
OTHER = "http://93.184.215.15:5000"


@pytest.mark.parametrize("answer", [
    httpx.Response(200, json={"run": {"info": {"run_id": "r" * 5000}}}),            # an id MLflow never makes
    httpx.Response(200, json={"run": {"info": {"run_id": "../../x"}}}),
    httpx.Response(200, content=b"[" * 300_000),                                    # too deep to parse
    httpx.Response(200, content=b" " * (mlflowlog.MAX_ANSWER_BYTES + 10)),           # too large to read
])
def test_a_hostile_server_costs_only_its_own_run_a_back_off(env: Any, answer: httpx.Response) -> None:
    engine, settings, good = env
    hostile_job = _job(engine, settings, {"tracking_uri": OTHER, "experiment": "exp"})
    good_job = _job(engine, settings, {"tracking_uri": URI, "experiment": "exp"})
    _steps(engine, good_job, range(1, 3))

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.host == httpx.URL(OTHER).host:
            if request.url.path.endswith("runs/create"):
                return answer
            return httpx.Response(200, json={"experiment": {"experiment_id": "1"}})
        return good.handle(request)

    mlflowlog.log_due(engine, settings, transport=httpx.MockTransport(route))
    bad = _row(engine, hostile_job)
    assert bad.run_id is None and bad.attempts == 1 and bad.status == TrackingState.LOGGING, bad.last_error
    assert "MlflowError" in (bad.last_error or "")
    (run,) = good.runs.values()
    assert len(run["metrics"]["train_loss"]) == 2 and _row(engine, good_job).attempts == 0
