"""Webhooks on the real cluster: a real job succeeds and the tenant's receiver (on 127.0.0.1, which
this gateway's settings allow) gets OpenAI's ``fine_tuning.job.succeeded`` event, signed so that the
official openai SDK's ``webhooks.unwrap`` accepts it with the endpoint's secret."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session

from tests.slurm.livegateway import LiveGateway, chat_file, terminal
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.slurm
T = "t-hooks"


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("hooks"), (T,), SFT_WEBHOOK_ALLOWED_HOSTS='["127.0.0.1"]')
    yield g
    g.stop()


def test_a_real_job_sends_a_signed_succeeded_event(gw: LiveGateway, tmp_path: Path) -> None:
    from openai import OpenAI

    from gateway.access.tokens import create_token
    from gateway.models import Role
    from gateway.services.tenants import ensure_tenant

    with Session(gw.engine) as s:
        admin, _ = create_token(session=s, role=Role.TENANT_ADMIN, tenant=ensure_tenant(session=s, name=T))
        s.commit()
    receiver = Receiver()
    try:
        r = gw.api("POST", "/v1/webhooks", T, headers={"Authorization": f"Bearer {admin}"},
                   json={"url": receiver.url})
        assert r.status_code == 200, r.text
        secret, wid = r.json()["secret"], r.json()["id"]
        job = gw.create(T, gw.upload(T, chat_file(tmp_path / "t.jsonl", 40, seed=91)))
        done = gw.wait(T, job["id"], terminal, 300)
        assert done["status"] == "succeeded", done["error"]
        deadline = time.monotonic() + 30
        while not receiver.got and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(receiver.got) == 1, receiver.got
        headers, body, _ = receiver.got[0]
        event = OpenAI(api_key="unused").webhooks.unwrap(body.decode(), headers, secret=secret)
        print(f"\nreceived {event.type} for {event.data.id}, webhook-id {headers['webhook-id']}")
        assert event.type == "fine_tuning.job.succeeded" and event.data.id == job["id"]
        log = gw.api("GET", f"/v1/webhooks/{wid}/deliveries", T).json()["data"]
        assert [(d["status"], d["attempts"]) for d in log] == [("delivered", 1)]
    finally:
        receiver.close()
