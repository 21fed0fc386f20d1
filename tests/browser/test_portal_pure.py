"""The portal's pure parts (unit tier: no browser): cookie signing, the job form, the loss series."""

from __future__ import annotations

import time

import pytest

from gateway.models import JobEvent
from gateway.portal.auth import safe_next
from gateway.portal.jobviews import loss_series, parse_job_form
from gateway.portal.session import sign, unsign

pytestmark = pytest.mark.unit
KEY = b"k" * 64


def test_signed_cookie_round_trip_and_tampering() -> None:
    value = sign(KEY, {"tid": 1, "csrf": "x", "exp": int(time.time()) + 60})
    assert unsign(KEY, value) == {"tid": 1, "csrf": "x", "exp": unsign(KEY, value)["exp"]}  # type: ignore[index]
    body, mac = value.rsplit(".", 1)
    assert unsign(KEY, body + "." + mac[::-1]) is None
    assert unsign(b"other" * 10, value) is None
    assert unsign(KEY, sign(KEY, {"tid": 1, "exp": int(time.time()) - 1})) is None   # expired
    assert unsign(KEY, None) is None and unsign(KEY, "garbage") is None


def test_next_is_only_a_portal_path() -> None:
    assert safe_next("/portal/jobs/x", "/d") == "/portal/jobs/x"
    for bad in ("https://evil.example/", "//evil.example/portal/", "/v1/files", "/portal\\..", None):
        assert safe_next(bad, "/d") == "/d"


def test_job_form_errors_name_the_field_and_keep_the_input() -> None:
    form, req, errors = parse_job_form({"model": "tiny-chat", "training_file": "file-1", "epochs": "0",
                                        "learning_rate": "fast", "lora_r": "8", "suffix": "a b"})
    assert req is None and form.epochs == "0" and form.learning_rate == "fast"
    assert set(errors) == {"epochs", "learning_rate", "suffix"}
    form, req, errors = parse_job_form({"model": "tiny-chat", "training_file": "file-1", "epochs": "2",
                                        "learning_rate": "0.001", "lora_r": "8", "max_seq_len": "256",
                                        "idempotency_key": "k1"})
    assert errors == {} and req is not None
    assert req.hyperparameters == {"epochs": 2, "lora_r": 8, "max_seq_len": 256, "learning_rate": 0.001}
    assert req.idempotency_key == "k1" and req.validation_file is None


def test_job_form_carries_the_dpo_method_and_its_beta() -> None:
    base = {"model": "tiny-chat", "training_file": "file-1", "epochs": "2", "learning_rate": "0.001", "lora_r": "8"}
    _, req, errors = parse_job_form({**base, "method": "dpo", "beta": "0.2"})
    assert errors == {} and req is not None and req.method == "dpo" and req.hyperparameters["beta"] == 0.2
    _, req, errors = parse_job_form({**base, "method": "dpo"})
    assert errors == {} and req is not None and "beta" not in req.hyperparameters
    for raw, field in (({"beta": "0.2"}, "beta"), ({"method": "dpo", "beta": "-1"}, "beta"),
                       ({"method": "rlhf"}, "method")):
        _, req, errors = parse_job_form({**base, **raw})
        assert req is None and set(errors) == {field}, (raw, errors)


def test_loss_series_in_step_order_from_metric_events() -> None:
    evs = [JobEvent(job_id="j", message="", type="metrics", data={"step": 2, "train_loss": 1.5}),
           JobEvent(job_id="j", message="", type="metrics", data={"step": 2, "valid_loss": 1.7}),
           JobEvent(job_id="j", message="", type="metrics", data={"step": 1, "train_loss": 2.0}),
           JobEvent(job_id="j", message="Phase: training", data={"phase": "training"})]
    assert loss_series(evs) == {"train": [[1, 2.0], [2, 1.5]], "eval": [[2, 1.7]]}
