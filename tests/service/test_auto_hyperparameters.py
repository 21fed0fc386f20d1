"""``"auto"`` through the real API: two uploaded files of 100 and 100,000 examples (token counts by the
tiny model's tokenizer at upload) get different epochs, batch size and learning rate, recorded at
create and shown in the job object (OpenAI's numbers and ours) and the estimate, and written into the
spec; values the request gives win. Slurm is replaced by a recording submitter: this is about what is
recorded and shown, not about training."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from gateway.config import Settings
from gateway.models import FineTuningJob
from tests.service.conftest import TENANT_A, Gateway, RecordingSubmitter
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS, JobSpec

pytestmark = pytest.mark.service
BASE_LR = HYPERPARAMETER_DEFAULTS["learning_rate"]
JOBS = "/v1/fine_tuning/jobs"


def short_lines(n: int) -> bytes:
    """``n`` distinct short chat examples (~50 tokens: a 100,000-line file is ~15 MB)."""
    return "".join(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": f"What is {i} plus {i}?"},
                                            {"role": "assistant", "content": f"It is {2 * i}."}]},
                              separators=(",", ":")) + "\n" for i in range(n)).encode()


@pytest.fixture
def gw_auto(settings: Settings, tiny_catalog: Path) -> Iterator[tuple[Gateway, RecordingSubmitter]]:
    g = Gateway(settings.model_copy(update={"default_model": "tiny-chat", "catalog_root": tiny_catalog,
                                            "max_upload_bytes": 64 * 1024 * 1024}))
    submitter = RecordingSubmitter()
    g.app.state.submitter = submitter
    yield g, submitter
    g.app.state.engine.dispose()


def _upload(gw: Gateway, n: int) -> str:
    started = time.monotonic()
    obj = gw.upload(TENANT_A, short_lines(n)).json()
    print(f"upload of {n} lines: {time.monotonic() - started:.1f} s")
    assert obj["status"] == "processed", obj
    assert obj["validation"]["stats"]["examples"] == n
    return str(obj["id"])


def _create(gw: Gateway, body: dict[str, Any]) -> dict[str, Any]:
    r = gw.client.post(JOBS, headers=gw.auth(TENANT_A), json={"model": "tiny-chat", **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_auto_differs_for_100_and_100000_examples_and_the_job_shows_it(
        gw_auto: tuple[Gateway, RecordingSubmitter]) -> None:
    gw, submitter = gw_auto
    small_file, large_file = _upload(gw, 100), _upload(gw, 100_000)
    small = _create(gw, {"training_file": small_file, "hyperparameters": {"n_epochs": "auto", "batch_size": "auto",
                                                                          "learning_rate_multiplier": "auto"}})
    large = _create(gw, {"training_file": large_file})           # absent is auto too
    print(json.dumps({"100 lines": small["hyperparameters"], "100,000 lines": large["hyperparameters"]}))
    print(json.dumps({"100 lines": small["method"]["supervised"]["hyperparameters"],
                      "100,000 lines": large["method"]["supervised"]["hyperparameters"]}))
    s_hp, l_hp = small["hyperparameters"], large["hyperparameters"]
    assert s_hp["n_epochs"] == 3 and l_hp["n_epochs"] == 1         # OpenAI's cookbook: 3, max(1, 25000 // n)
    assert all(isinstance(hp[k], int | float) for hp in (s_hp, l_hp) for k in hp)     # numbers, not "auto"
    assert s_hp["batch_size"] <= 100 < l_hp["batch_size"]
    assert s_hp["learning_rate_multiplier"] != l_hp["learning_rate_multiplier"]
    ours = {name: job["method"]["supervised"]["hyperparameters"] for name, job in (("s", small), ("l", large))}
    assert ours["s"]["batch_size_tokens"] < ours["l"]["batch_size_tokens"]
    assert ours["s"]["epochs"] == 3 and ours["l"]["epochs"] == 1 and "auto" not in ours["s"]
    for job, hp in ((small, ours["s"]), (large, ours["l"])):
        assert hp["learning_rate"] == pytest.approx(job["hyperparameters"]["learning_rate_multiplier"] * BASE_LR)
        spec = submitter.specs[job["id"]].hyperparameters          # the spec the trainer gets: the same numbers
        assert (spec.epochs, spec.batch_size_tokens, spec.learning_rate) == \
            (hp["epochs"], hp["batch_size_tokens"], hp["learning_rate"])
    again = gw.client.get(f"{JOBS}/{large['id']}", headers=gw.auth(TENANT_A)).json()
    assert again["hyperparameters"] == l_hp                         # recorded, not recomputed
    assert rebuilt_spec(gw, large["id"]) == submitter.specs[large["id"]]   # a resubmission trains the same

    est = gw.client.post(f"{JOBS}/estimate", headers=gw.auth(TENANT_A),
                         json={"model": "tiny-chat", "training_file": large_file})
    assert est.status_code == 200, est.text
    assert {k: est.json()["hyperparameters"][k] for k in l_hp} == l_hp
    assert est.json()["batch_size_tokens"] == ours["l"]["batch_size_tokens"]
    assert est.json()["estimated_tokens"] == large_tokens(gw, large["id"])


def rebuilt_spec(gw: Gateway, job_id: str) -> JobSpec | None:
    """The spec recovery would submit again for ``job_id`` (``services.recovery``: from the row)."""
    from gateway.models import Tenant
    from gateway.services import recovery

    with Session(gw.app.state.engine) as session:
        job = session.get(FineTuningJob, job_id)
        tenant = session.exec(select(Tenant).where(Tenant.name == TENANT_A)).one()
        assert job is not None
        return recovery._rebuilt_spec(session, gw.settings, job, tenant)


def large_tokens(gw: Gateway, job_id: str) -> int:
    with Session(gw.app.state.engine) as session:
        job = session.get(FineTuningJob, job_id)
        assert job is not None and job.estimated_tokens is not None
        return job.estimated_tokens


def test_given_values_win_and_count_in_the_rest(gw_auto: tuple[Gateway, RecordingSubmitter]) -> None:
    gw, submitter = gw_auto
    fid = _upload(gw, 100)
    job = _create(gw, {"training_file": fid, "method": {"type": "supervised", "supervised": {"hyperparameters": {
        "n_epochs": 2, "learning_rate_multiplier": 3, "batch_size_tokens": 4096}}}})
    hp = job["method"]["supervised"]["hyperparameters"]
    assert (hp["epochs"], hp["batch_size_tokens"], hp["learning_rate"]) == (2, 4096, pytest.approx(3 * BASE_LR))
    assert job["hyperparameters"]["n_epochs"] == 2
    assert job["hyperparameters"]["learning_rate_multiplier"] == pytest.approx(3)
    assert isinstance(job["hyperparameters"]["batch_size"], int)      # what 4096 tokens hold of this file
    only_epochs = _create(gw, {"training_file": fid, "hyperparameters": {"n_epochs": 5}})
    assert only_epochs["hyperparameters"]["n_epochs"] == 5
    assert only_epochs["method"]["supervised"]["hyperparameters"]["batch_size_tokens"] == \
        HYPERPARAMETER_DEFAULTS["max_seq_len"]                       # chosen: one row holds 100 short examples
    r = gw.client.post(JOBS, headers=gw.auth(TENANT_A),
                       json={"model": "tiny-chat", "training_file": fid, "hyperparameters": {"auto": {}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.auto", r.text


def test_sweep_runs_resolve_what_their_point_leaves_auto(gw_auto: tuple[Gateway, RecordingSubmitter]) -> None:
    gw, _ = gw_auto
    train, val = _upload(gw, 100), _upload(gw, 20)
    r = gw.client.post("/v1/fine_tuning/sweeps", headers=gw.auth(TENANT_A), json={
        "model": "tiny-chat", "training_file": train, "validation_file": val,
        "grid": {"learning_rate_multiplier": [0.5, 4], "lora_r": [4]}})
    assert r.status_code == 200, r.text
    jobs = [gw.client.get(f"{JOBS}/{run['job_id']}", headers=gw.auth(TENANT_A)).json() for run in r.json()["runs"]]
    single = _create(gw, {"training_file": train})
    for job, multiplier in zip(jobs, (0.5, 4), strict=True):
        hp = job["hyperparameters"]
        assert hp["learning_rate_multiplier"] == pytest.approx(multiplier)            # the grid's value wins
        assert (hp["n_epochs"], hp["batch_size"]) == (single["hyperparameters"]["n_epochs"],
                                                      single["hyperparameters"]["batch_size"])   # as one job's


def test_dpo_and_a_gang_get_a_step_that_holds_their_rows(gw_auto: tuple[Gateway, RecordingSubmitter]) -> None:
    gw, submitter = gw_auto
    pairs = "".join(json.dumps({"input": {"messages": [{"role": "user", "content": f"Say {i}."}]},
                                "preferred_output": [{"role": "assistant", "content": f"{i}."}],
                                "non_preferred_output": [{"role": "assistant", "content": f"No, {i + 1}."}]}) + "\n"
                    for i in range(100)).encode()
    obj = gw.upload(TENANT_A, pairs, filename="pairs.jsonl").json()
    assert obj["status"] == "processed", obj
    dpo = _create(gw, {"training_file": obj["id"], "method": {"type": "dpo", "dpo": {"hyperparameters": {
        "max_seq_len": 512}}}})
    spec = submitter.specs[dpo["id"]]
    assert spec.method == "dpo" and spec.hyperparameters.batch_size_tokens >= 2 * 512
    est = gw.client.post(f"{JOBS}/estimate", headers=gw.auth(TENANT_A), json={
        "model": "tiny-chat", "training_file": _upload(gw, 100), "resources": {"gpus": 2, "nodes": 2}})
    assert est.status_code == 200, est.text
    seq = HYPERPARAMETER_DEFAULTS["max_seq_len"]
    assert est.json()["batch_size_tokens"] == 2 * seq
    assert any(f"widened from the chosen {seq} to {2 * seq}" in w for w in est.json()["warnings"]), est.json()
