"""Webhooks: only public http(s) URLs unless the site allows the host (a refusal names the host, not
what it resolved to); tenant admins register, members read; another tenant's endpoint is 404; a
delivery is signed so that the official openai SDK's ``webhooks.unwrap`` accepts it, and a receiver
that fails twice gets it on the third try; a pinned https connection keeps the URL's name for SNI
and the certificate check."""

from __future__ import annotations

import datetime
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from gateway.access.tokens import create_token
from gateway.config import Settings
from gateway.models import FineTuningJob, Role, Tenant, WebhookDelivery
from gateway.services import netguard, webhooks
from gateway.services.tenants import ensure_tenant
from gateway.state import JobState
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
    if url.startswith("http://localhost") or url.startswith("http://no-such"):
        assert "is not a public address" in r.text and "127.0.0.1" not in r.text and "::1" not in r.text, r.text


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


def _ended_job(gw: Gateway, state: JobState) -> str:
    """A job of TENANT_A that ended in ``state``, its deliveries enqueued as the transition does; its id."""
    fid = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    with Session(gw.app.state.engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == TENANT_A)).one()
        job = FineTuningJob(tenant_id=tenant.id, training_file=fid, model="tiny-chat", status=state.value)  # type: ignore[arg-type]
        s.add(job)
        s.flush()
        webhooks.enqueue(s, job, state)
        s.commit()
        return job.id


def test_a_signed_delivery_verifies_with_the_openai_sdk_after_two_failures(gw: Gateway, receiver: Receiver) -> None:
    from openai import OpenAI

    settings: Settings = gw.settings
    settings.webhook_allowed_hosts, settings.webhook_retry_base_s = ["127.0.0.1"], 0.0
    reg = gw.client.post("/v1/webhooks", headers=_admin(gw, TENANT_A), json={"url": receiver.url}).json()
    engine = gw.app.state.engine
    jid = _ended_job(gw, JobState.SUCCEEDED)
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


def test_a_delivery_to_a_host_no_longer_allowed_is_refused_without_its_address(gw: Gateway) -> None:
    settings: Settings = gw.settings
    settings.webhook_allowed_hosts, settings.webhook_max_attempts = ["localhost"], 1
    reg = gw.client.post("/v1/webhooks", headers=_admin(gw, TENANT_A), json={"url": "http://localhost:9/h"}).json()
    engine = gw.app.state.engine
    _ended_job(gw, JobState.FAILED)
    settings.webhook_allowed_hosts = []
    assert webhooks.deliver_due(engine, settings) == 0
    [d] = gw.client.get(f"/v1/webhooks/{reg['id']}/deliveries", headers=gw.auth(TENANT_A)).json()["data"]
    assert d["status"] == "failed" and d["last_status"] is None
    assert "localhost is not a public address" in d["last_error"], d
    assert "127.0.0.1" not in d["last_error"] and "::1" not in d["last_error"]


class _TLSReceiver:
    """https on 127.0.0.1 with a self-signed certificate for ``name``; records SNI and Host."""

    def __init__(self, tmp: Path, name: str):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(hours=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        self.cert, keyfile = tmp / "cert.pem", tmp / "key.pem"
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        self.sni: list[str | None] = []
        self.hosts: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.hosts.append(self.headers.get("host"))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, keyfile)
        ctx.sni_callback = lambda sock, server_name, _ctx: outer.sni.append(server_name)  # type: ignore[assignment,misc,func-returns-value]
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_pinned_https_connection_keeps_the_hostname_for_sni_and_the_certificate(tmp_path: Path) -> None:
    tls = _TLSReceiver(tmp_path, "hooks.example")
    try:
        trust = ssl.create_default_context(cafile=str(tls.cert))
        pinned = netguard.PinnedTransport([ip_address("127.0.0.1")], verify=trust)
        with httpx.Client(transport=pinned, timeout=5) as client:      # hooks.example resolves nowhere
            r = client.post(f"https://hooks.example:{tls.port}/hook", content=b"{}")
        assert r.status_code == 200
        assert tls.sni == ["hooks.example"] and tls.hosts == [f"hooks.example:{tls.port}"]
        pinned = netguard.PinnedTransport([ip_address("127.0.0.1")], verify=trust)
        with httpx.Client(transport=pinned, timeout=5) as client, \
                pytest.raises(httpx.ConnectError, match="certificate verify failed"):
            client.post(f"https://other.example:{tls.port}/hook", content=b"{}")   # the certificate's name is checked
        assert tls.hosts == [f"hooks.example:{tls.port}"]
    finally:
        tls.close()
