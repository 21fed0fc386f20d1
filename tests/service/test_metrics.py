"""``GET /metrics``: the Prometheus text format (parsed with prometheus_client's own parser), for
sysadmin tokens only; request counts by route template (never an id), jobs by tenant and state,
a running job's pace and ages."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import Session, select

from gateway.models import FineTuningJob, Tenant
from tests.service.conftest import TENANT_A, Gateway, chat_lines

pytestmark = pytest.mark.service


def _families(gw: Gateway) -> dict[str, list[tuple[dict[str, str], float]]]:
    r = gw.client.get("/metrics", headers=gw.auth("sysadmin"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(r.text)}


def test_metrics_are_for_sysadmins_only(gw: Gateway) -> None:
    assert gw.client.get("/metrics").status_code == 401
    assert gw.client.get("/metrics", headers=gw.auth(TENANT_A)).status_code == 403


def test_requests_jobs_and_a_running_job_are_exported(gw: Gateway) -> None:
    for _ in range(3):
        assert gw.client.get("/v1/fine_tuning/jobs/ftjob-nosuch", headers=gw.auth(TENANT_A)).status_code == 404
    fid = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    now = time.time()
    with Session(gw.app.state.engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == TENANT_A)).one()
        job = FineTuningJob(tenant_id=tenant.id, training_file=fid, model="tiny-chat", status="running",  # type: ignore[arg-type]
                            phase="training", progress={"tokens_per_s": 5559.8, "seen_at": now - 4.0,
                                                        "checkpoint_at": [now - 30.0, 12]})
        s.add(job)
        s.commit()
        jid = job.id
    fam = _families(gw)
    hits = [(labels, v) for labels, v in fam["sft_http_requests"] if labels["status"] == "404"]
    assert hits == [({"method": "GET", "route": "/v1/fine_tuning/jobs/{job_id}", "status": "404"}, 3.0)]
    assert not [labels for labels, _ in fam["sft_http_requests"] if "ftjob-nosuch" in labels["route"]]
    counts = {s[0]["le"]: s[1] for s in fam["sft_http_request_seconds"]
              if s[0].get("route") == "/v1/fine_tuning/jobs/{job_id}" and "le" in s[0]}
    assert counts["+Inf"] == 3.0
    assert ({"tenant": TENANT_A, "status": "running", "phase": "training"}, 1.0) in fam["sft_jobs"]
    assert fam["sft_job_tokens_per_second"] == [({"tenant": TENANT_A, "job": jid}, 5559.8)]
    (labels, age), = fam["sft_job_step_age_seconds"]
    assert labels["job"] == jid and 4.0 <= age < 60
    (_, ck_age), = fam["sft_job_checkpoint_age_seconds"]
    assert 30.0 <= ck_age < 90
    assert "sft_reconcile_cycles" in fam and "sft_detector_findings" in fam and "sft_reconcile_record_alerts" in fam


def test_the_sample_dashboard_asks_only_for_metrics_the_gateway_exports(gw: Gateway) -> None:
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    asked = {re.sub(r"_(total|bucket|sum|count)$", "", name) for p in dash["panels"] for t in p["targets"]
             for name in re.findall(r"\bsft_[a-z_]+", t["expr"])}
    assert asked and asked <= set(_families(gw)), asked - set(_families(gw))
