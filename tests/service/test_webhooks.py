"""Webhooks: only public http(s) URLs unless the site allows the host; tenant admins register, members
read; another tenant's endpoint is 404; a delivery is signed so that the official openai SDK's
``webhooks.unwrap`` accepts it, and a receiver that fails twice gets it on the third try."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlmodel import Session, select

from gateway.access.tokens import create_token
from gateway.config import Settings
from gateway.jobs.state import JobState
from gateway.models import FineTuningJob, Role, Tenant, WebhookDelivery
from gateway.services import webhooks
from gateway.services.tenants import ensure_tenant
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, chat_lines
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.service


def _admin(gw: Gateway, tenant: str) -> dict[str, str]:
    with Session(gw.app.state.engine) as s:
        token, _ = create_token(session=s, role=Role.TENANT_ADMIN, tenant=ensure_tenant(session=s, name=tenant))
        s.commit()
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://localhost/hook", "http://169.254.169.254/latest",
                                 "http://10.1.2.3/hook", "http://[::1]/hook", "ftp://example.org/hook",
                                 "https://user:pw@example.org/hook", "http://no-such-host.invalid/hook"])
def test_default_settings_refuse_non_public_and_odd_urls(gw: Gateway, url: str) -> None:
    r = gw.client.post("/v1/webhooks", headers=_admin(gw, TENANT_A), json={"url": url})
    assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text


def test_admins_register_members_read_others_see_nothing(gw: Gateway) -> None:
    gw.settings.webhook_allowed_hosts = ["127.0.0.1"]
    r = gw.client.post("/v1/webhooks", headers=gw.auth(TENANT_A), json={"url": "http://127.0.0.1:9/h"})
    assert r.status_code == 403                                   # a member cannot register
    r = gw.client.post("/v1/webhooks", headers=_admin(gw, TENANT_A), json={"url": "http://127.0.0.1:9/h"})
    assert r.status_code == 200 and r.json()["secret"].startswith("whsec_"), r.text
    wid = r.json()["id"]
    listed = gw.client.get("/v1/webhooks", headers=gw.auth(TENANT_A)).json()["data"]
    assert [w["id"] for w in listed] == [wid] and "secret" not in listed[0]
    assert gw.client.get("/v1/webhooks", headers=gw.auth(TENANT_B)).json()["data"] == []
    assert gw.client.get(f"/v1/webhooks/{wid}/deliveries", headers=gw.auth(TENANT_B)).status_code == 404
    assert gw.client.delete(f"/v1/webhooks/{wid}", headers=_admin(gw, TENANT_B)).status_code == 404
    assert gw.client.get(f"/v1/webhooks/{wid}/deliveries", headers=gw.auth(TENANT_A)).json()["data"] == []


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(fail_first=2)
    yield r
    r.close()


def test_a_signed_delivery_verifies_with_the_openai_sdk_after_two_failures(gw: Gateway, receiver: Receiver) -> None:
    from openai import OpenAI

    settings: Settings = gw.settings
    settings.webhook_allowed_hosts, settings.webhook_retry_base_s = ["127.0.0.1"], 0.0
    reg = gw.client.post("/v1/webhooks", headers=_admin(gw, TENANT_A), json={"url": receiver.url}).json()
    fid = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    engine = gw.app.state.engine
    with Session(engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == TENANT_A)).one()
        job = FineTuningJob(tenant_id=tenant.id, training_file=fid, model="tiny-chat", status="succeeded")  # type: ignore[arg-type]
        s.add(job)
        s.flush()
        webhooks.enqueue(s, job, JobState.SUCCEEDED)
        s.commit()
        jid = job.id
    assert [webhooks.deliver_due(engine, settings) for _ in range(3)] == [0, 0, 1]
    assert [code for _, _, code in receiver.got] == [500, 500, 200]
    headers, body, _ = receiver.got[-1]
    event = OpenAI(api_key="unused").webhooks.unwrap(body.decode(), headers, secret=reg["secret"])
    assert event.type == "fine_tuning.job.succeeded" and event.data.id == jid
    assert len({h["webhook-id"] for h, _, _ in receiver.got}) == 1          # retries keep the message id
    with pytest.raises(Exception, match="signature"):
        OpenAI(api_key="unused").webhooks.unwrap(body.decode(), headers, secret="whsec_" + "A" * 32)
    log = gw.client.get(f"/v1/webhooks/{reg['id']}/deliveries", headers=gw.auth(TENANT_A)).json()["data"]
    assert [(d["status"], d["attempts"], d["last_status"], d["job_id"]) for d in log] == [("delivered", 3, 200, jid)]
    with Session(engine) as s:
        assert json.loads(s.exec(select(WebhookDelivery)).one().body)["data"] == {"id": jid}
