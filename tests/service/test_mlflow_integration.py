"""The MLflow integration through the real API and database (SQLite and PostgreSQL): a wrong entry is a 400
naming ``integrations[0]...``, a right one is recorded with its credentials sealed, and the job object (at
create, retrieve and list) shows it without them; a sweep records a parent run and a child run per job.
Slurm is replaced by a recording submitter; the logging itself is tests/unit/test_mlflow_logger.py and,
against a real MLflow server, tests/slurm/test_mlflow_live.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session

from gateway.config import Settings
from gateway.models import FineTuningJob, MlflowParentRun, MlflowRun
from gateway.services import tracking
from tests.service.conftest import TENANT_A, Gateway, chat_lines
from trainer.contract.spec import JobSpec

pytestmark = pytest.mark.service
JOBS = "/v1/fine_tuning/jobs"
URI = "http://93.184.215.14:5000"        # public, literal: no DNS needed
SECRET = "mlflow-token-" + "x7" * 10


class RecordingSubmitter:
    """``jobcreate.Submit`` without Slurm."""

    def __call__(self, job: FineTuningJob, spec: JobSpec, tenant: str) -> tuple[int, str]:
        return 4242, "ft-small"

    def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
        return "ft-small"


@pytest.fixture
def gw_ml(settings: Settings, tiny_catalog: Path, tmp_path: Path) -> Iterator[Gateway]:
    g = Gateway(settings.model_copy(update={"default_model": "tiny-chat", "catalog_root": tiny_catalog,
                                            "integration_key_file": tmp_path / "integrations.key"}))
    g.app.state.submitter = RecordingSubmitter()
    yield g
    g.app.state.engine.dispose()


def _body(gw: Gateway, integrations: list[Any]) -> dict[str, Any]:
    file_id = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    return {"model": "tiny-chat", "training_file": file_id, "integrations": integrations}


@pytest.mark.parametrize(("integration", "param"), [
    ({"type": "wandb", "wandb": {"project": "p"}}, "integrations[0].type"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": "http://127.0.0.1:5000", "experiment": "e"}},
     "integrations[0].mlflow.tracking_uri"),
    ({"type": "mlflow", "mlflow": {"tracking_uri": URI}}, "integrations[0].mlflow.experiment"),
])
def test_a_wrong_integration_is_a_400_naming_it(gw_ml: Gateway, integration: dict[str, Any], param: str) -> None:
    body = _body(gw_ml, [integration])
    for url in (JOBS, f"{JOBS}/estimate"):          # the estimate answers the same body with the same errors
        r = gw_ml.client.post(url, headers=gw_ml.auth(TENANT_A), json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_mlflow_integration_is_recorded_sealed_and_shown_without_credentials(gw_ml: Gateway) -> None:
    entry = {"type": "mlflow", "mlflow": {"tracking_uri": URI + "/", "experiment": "ft", "run_name": "r1",
                                          "token": SECRET}}
    headers = {**gw_ml.auth(TENANT_A), "Idempotency-Key": "k1"}
    body = _body(gw_ml, [entry])
    r = gw_ml.client.post(JOBS, headers=headers, json=body)
    assert r.status_code == 200, r.text
    shown = [{"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "ft", "run_name": "r1",
                                           "auth": "token"}}]
    job = r.json()
    assert job["integrations"] == shown and SECRET not in r.text
    again = gw_ml.client.get(f"{JOBS}/{job['id']}", headers=gw_ml.auth(TENANT_A))
    listed = gw_ml.client.get(JOBS, headers=gw_ml.auth(TENANT_A))
    assert again.json()["integrations"] == shown and listed.json()["data"][0]["integrations"] == shown
    assert SECRET not in again.text + listed.text
    retry = gw_ml.client.post(JOBS, headers=headers, json=body)       # same key, same body: the same job
    assert retry.status_code == 200 and retry.json()["id"] == job["id"]
    with Session(gw_ml.app.state.engine) as s:
        row = s.get(MlflowRun, job["id"])
        assert row is not None and row.credentials and SECRET not in row.credentials
        assert tracking.credentials(row, gw_ml.settings) == {"token": SECRET}
        stored = s.get(FineTuningJob, job["id"])
        assert stored is not None and SECRET not in str(stored.request_hash) + str(stored.integrations)


def test_a_sweep_with_mlflow_records_a_parent_run_and_a_child_per_job(gw_ml: Gateway) -> None:
    val = gw_ml.upload(TENANT_A, chat_lines(12, start=50)).json()["id"]
    body = {**_body(gw_ml, [{"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "grid",
                                                          "run_name": "g", "token": SECRET}}]),
            "validation_file": val, "grid": {"learning_rate": [1e-4, 1e-3]}}
    r = gw_ml.client.post("/v1/fine_tuning/sweeps", headers=gw_ml.auth(TENANT_A), json=body)
    assert r.status_code == 200, r.text
    sweep = r.json()
    assert sweep["integrations"] == [{"type": "mlflow", "mlflow": {"tracking_uri": URI, "experiment": "grid",
                                                                   "run_name": "g"}}] and SECRET not in r.text
    names = [gw_ml.client.get(f"{JOBS}/{run['job_id']}", headers=gw_ml.auth(TENANT_A)).json()["integrations"][0]
             ["mlflow"]["run_name"] for run in sweep["runs"]]
    assert names == ["g-0", "g-1"]
    with Session(gw_ml.app.state.engine) as s:
        parent = s.get(MlflowParentRun, sweep["id"])
        children = [s.get(MlflowRun, run["job_id"]) for run in sweep["runs"]]
        assert parent is not None and all(c is not None and c.sweep_id == sweep["id"] for c in children)
    bad = {**body, "integrations": [{"type": "mlflow", "mlflow": {"tracking_uri": "http://10.0.0.1"}}]}
    r = gw_ml.client.post("/v1/fine_tuning/sweeps", headers=gw_ml.auth(TENANT_A), json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("integrations[0].mlflow"), r.text
