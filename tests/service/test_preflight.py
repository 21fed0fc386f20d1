"""Checks that come at create and estimate, not on the node (issue 35): a ``max_seq_len`` under the
file's longest example (counted with the base's own tokenizer at upload) is a 400 naming it, at the
estimate as at create, instead of "expected start: now" and a job that fails when it tokenizes; and
the same bytes uploaded for another base model are validated with that model's tokenizer (a file row
of their own), not handed back with the first model's report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import Settings
from tests.service.conftest import TENANT_A, Gateway, RecordingSubmitter, chat_lines
from tests.service.test_tool_datasets import two_models  # noqa: F401 - the fixture

pytestmark = pytest.mark.service
JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture
def gw_pre(settings: Settings, two_models: Path) -> Iterator[Gateway]:  # noqa: F811 - the imported fixture
    g = Gateway(settings.model_copy(update={"default_model": "tiny-chat", "catalog_root": two_models}))
    g.app.state.submitter = RecordingSubmitter()
    yield g
    g.app.state.engine.dispose()


def test_max_seq_len_under_the_longest_example_is_refused_at_estimate_and_create(gw_pre: Gateway) -> None:
    gw = gw_pre
    obj = gw.upload(TENANT_A, chat_lines(12)).json()
    longest = obj["validation"]["stats"]["tokens"]["max"]
    assert obj["validation"]["stats"]["tokenizer"] == "tiny-chat" and longest > 16
    body = {"model": "tiny-chat", "training_file": obj["id"],
            "hyperparameters": {"n_epochs": 1, "max_seq_len": longest - 1, "batch_size_tokens": 1024}}
    for url in (JOBS + "/estimate", JOBS):
        r = gw.client.post(url, headers=gw.auth(TENANT_A), json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "hyperparameters.max_seq_len"
        assert f"longest example is {longest} tokens" in err["message"] and f"at least {longest}" in err["message"]
    body["hyperparameters"]["max_seq_len"] = longest
    assert gw.client.post(JOBS + "/estimate", headers=gw.auth(TENANT_A), json=body).status_code == 200
    assert gw.client.post(JOBS, headers=gw.auth(TENANT_A), json=body).status_code == 200


def test_the_same_bytes_for_another_model_are_validated_with_its_tokenizer(gw_pre: Gateway) -> None:
    gw = gw_pre
    data = chat_lines(12)

    def upload(model: str | None) -> dict:  # type: ignore[type-arg]
        query = f"?model={model}" if model else ""
        r = gw.client.post(f"/v1/files{query}", headers=gw.auth(TENANT_A), data={"purpose": "fine-tune"},
                           files={"file": ("t.jsonl", data, "application/jsonl")})
        assert r.status_code == 200, r.text
        return dict(r.json())

    first, plain, again, default = upload("tiny-chat"), upload("tiny-plain"), upload("tiny-chat"), upload(None)
    assert plain["id"] != first["id"] and plain["validation"]["stats"]["tokenizer"] == "tiny-plain"
    assert plain["model"] == "tiny-plain" and first["model"] == "tiny-chat"
    assert again["id"] == first["id"] and default["id"] == first["id"]       # same bytes, same tokenizer


def test_a_path_where_a_file_id_goes_is_recognised(gw_pre: Gateway, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    from tests.service.conftest import cli_over

    gw = gw_pre
    r = gw.client.post(JOBS, headers=gw.auth(TENANT_A),
                       json={"model": "tiny-chat", "training_file": "data/train.jsonl"})
    assert r.status_code == 400, r.text
    assert "looks like a path, not a file id" in r.json()["error"]["message"] and "pattern" not in r.text
    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_lines(12))
    rc, out = cli_over(gw, monkeypatch)(gw.tokens[TENANT_A], "jobs", "create", "--training-file", str(path),
                                        "--model", "tiny-chat")
    assert rc == 2 and f"did you mean `finetune files upload {path}`" in " ".join(out.split())


def test_a_time_limit_the_request_gives_is_the_jobs(gw_pre: Gateway) -> None:
    """``resources.time_limit_minutes`` (``--time``): the estimate and the job take it instead of the
    estimated limit (a slow machine, a job that timed out); over the site's limit it is a 400."""
    from sqlmodel import Session

    from gateway.models import FineTuningJob

    gw = gw_pre
    file_id = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    body = {"model": "tiny-chat", "training_file": file_id, "hyperparameters": {"n_epochs": 1},
            "resources": {"time_limit_minutes": 37}}
    est = gw.client.post(JOBS + "/estimate", headers=gw.auth(TENANT_A), json=body)
    assert est.status_code == 200 and est.json()["time_limit_minutes"] == 37, est.text
    job = gw.client.post(JOBS, headers=gw.auth(TENANT_A), json=body).json()
    with Session(gw.app.state.engine) as s:
        row = s.get(FineTuningJob, job["id"])
        assert row is not None and row.time_limit_min == 37
    body["resources"] = {"time_limit_minutes": gw.settings.max_wall_min + 1}
    over = gw.client.post(JOBS, headers=gw.auth(TENANT_A), json=body)
    assert over.status_code == 400 and "limit" in over.json()["error"]["message"]
