"""What ``finetune jobs show`` prints for a finished job (issue 35): the eval loss before -> after, how
long it took, its result files by name, and each hyperparameter once (ours, not OpenAI's name beside it).
The job's row is given a finished job's facts directly: this is about the output, not about training."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import Session

from gateway.models import DataFile, FineTuningJob
from tests.service.conftest import TENANT_A, Gateway, chat_lines, cli_over
from tests.service.test_metadata_filter import gw_meta  # noqa: F401 - the fixture

pytestmark = pytest.mark.service


def test_jobs_show_gives_eval_duration_result_names_and_one_name_per_hyperparameter(
        gw_meta: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the imported fixture
    gw = gw_meta
    file_id = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    job = gw.client.post("/v1/fine_tuning/jobs", headers=gw.auth(TENANT_A),
                         json={"model": "tiny-chat", "training_file": file_id,
                               "hyperparameters": {"n_epochs": 2, "learning_rate_multiplier": 2}}).json()
    with Session(gw.app.state.engine) as s:
        row = s.get(FineTuningJob, job["id"])
        assert row is not None
        result = DataFile(tenant_id=row.tenant_id, filename=f"{row.id}-adapter.tar", purpose="fine-tune-results",
                          bytes=10, sha256="0" * 64, status="processed", path="artifacts/x/adapter.tar", job_id=row.id)
        s.add(result)
        s.flush()
        row.status, row.finished_at = "succeeded", row.created_at + timedelta(minutes=2, seconds=5)
        row.progress = {"evals": [{"when": "before", "step": 0, "loss": 3.4712},
                                  {"when": "after", "step": 12, "loss": 0.5893}]}
        row.result_files = [result.id]
        result_id = result.id
        s.add(row)
        s.commit()
    rc, out = cli_over(gw, monkeypatch)(gw.tokens[TENANT_A], "jobs", "show", job["id"])
    assert rc == 0, out
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines()[1:]
             if ":" in line}
    assert lines["eval loss"] == "3.4712 -> 0.5893 (step 12)"
    assert lines["took"] == "2m05s"
    assert lines["result files"] == f"{result_id} (adapter.tar)"
    hp = lines["hyperparameters"]
    assert "epochs=2" in hp and "n_epochs" not in hp and "learning_rate_multiplier" not in hp
