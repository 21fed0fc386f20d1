"""DNS rebinding, for real: a name whose DNS server (dnsmasq) answers a public-looking address to the
gateway's check and 127.0.0.1 right after it must never bring a delivery to a receiver on loopback.

The scenario runs in its own mount, network and pid namespaces (``unshare``, root): /etc/resolv.conf
is bind-mounted to name our dnsmasq, so the gateway and httpx use the ordinary system resolver; the
"public" address is put on the namespace's own lo, where a second listener stands for the real
receiver, so nothing leaves the machine. The DNS answer changes between the check and the connection
(the worst moment). A client that resolves again (what ``deliver_due`` did before) reaches the
loopback receiver: that control shows the rebinding is real. The gateway instead delivers to the
address it checked, with the URL's Host; on the next try the name answers 127.0.0.1 and the delivery
is refused, recorded with a message that names the host and not the address.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[2]
NAME = "rebind.test"
PUBLIC = "93.184.215.14"        # passes the deny list; inside the namespace it lives on lo
NAMESERVER = "127.0.0.153"
DNSMASQ = shutil.which("dnsmasq") or next((p for p in ("/usr/sbin/dnsmasq",) if os.path.exists(p)), None)
NAMESPACED = ('mount --bind "$1/resolv.conf" /etc/resolv.conf && ip link set lo up && '
              f'ip addr add {PUBLIC}/32 dev lo && exec "$2" -m tests.service.test_webhook_rebinding "$1"')


def test_a_name_that_rebinds_to_loopback_after_the_check_never_reaches_loopback(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the scenario runs in its own mount and network namespaces (unshare)")
    if DNSMASQ is None:
        pytest.skip("needs dnsmasq (Debian package dnsmasq-base; scripts/bootstrap.sh installs it)")
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("mount")):
        pytest.skip("needs unshare, mount (util-linux) and ip (iproute2)")
    (tmp_path / "resolv.conf").write_text(f"nameserver {NAMESERVER}\noptions timeout:1 attempts:2\n")
    res = subprocess.run(["unshare", "--mount", "--net", "--pid", "--kill-child", "--", "sh", "-c", NAMESPACED,
                          "sh", str(tmp_path), sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=180)
    log = (tmp_path / "dnsmasq.log").read_text() if (tmp_path / "dnsmasq.log").exists() else ""
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{log}"
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(got, indent=1))
    assert got["checked"] == [PUBLIC] and got["resolver_after_check"] == ["127.0.0.1"]   # it did rebind
    assert got["naive_client_reached_loopback"]                  # a client that resolves again is fooled
    assert got["loopback_got"] == [{"probe": "naive", "webhook_id": None}]    # the gateway never got there
    assert got["public_got"] == [{"host": f"{NAME}:{got['port']}", "webhook_id": got["delivery_id"]}]
    assert got["first_try"] == {"last_status": 500, "last_error": "HTTP 500"}  # the checked address answered
    last = got["delivery"]
    assert (last["status"], last["attempts"], last["last_status"]) == ("failed", 2, None), last
    assert f"{NAME} is not a public address" in last["last_error"] and "127.0.0.1" not in last["last_error"], last


# ------------------------------------------------------------- inside the namespaces
class _Listener:
    """The receiver at the checked ("public") address: records Host and webhook-id, answers 500."""

    def __init__(self, address: str, port: int):
        self.got: list[dict[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.got.append({"host": self.headers.get("host"), "webhook_id": self.headers.get("webhook-id")})
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((address, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _answers() -> list[str]:
    """What the system resolver (what httpx uses) says ``NAME`` is now."""
    try:
        return sorted({str(i[4][0]) for i in socket.getaddrinfo(NAME, 80, type=socket.SOCK_STREAM)})
    except socket.gaierror:
        return []


def _wait_for(answer: list[str]) -> list[str]:
    deadline = time.monotonic() + 15
    while (now := _answers()) != answer and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def _scenario(tmp: Path) -> dict[str, Any]:
    import httpx
    from sqlmodel import Session

    from gateway.config import Settings
    from gateway.db import make_engine, migrate
    from gateway.models import WebhookDelivery, WebhookEndpoint
    from gateway.services import webhooks
    from gateway.services.tenants import ensure_tenant
    from tests.webhook_receiver import Receiver

    hosts = tmp / "hosts"
    hosts.write_text(f"{PUBLIC} {NAME}\n")
    assert DNSMASQ is not None
    dns = subprocess.Popen([DNSMASQ, "--conf-file=/dev/null", "--keep-in-foreground", "--no-resolv", "--no-hosts",
                            f"--addn-hosts={hosts}", "--local=/test/", "--local-ttl=0",
                            f"--listen-address={NAMESERVER}", "--bind-interfaces", "--port=53", "--user=root",
                            "--group=root", f"--pid-file={tmp}/dnsmasq.pid", "--log-queries",
                            f"--log-facility={tmp}/dnsmasq.log"])
    loopback = Receiver()
    port = int(loopback.server.server_address[1])
    public = _Listener(PUBLIC, port)
    report: dict[str, Any] = {"port": port}
    try:
        assert _wait_for([PUBLIC]) == [PUBLIC], "dnsmasq did not answer"
        settings = Settings(database_url=f"sqlite:///{tmp}/gateway.db", storage_root=tmp, webhook_timeout_s=5,
                            webhook_retry_base_s=0.0, webhook_max_attempts=2)
        engine = make_engine(settings.database_url)
        migrate(engine)
        url = f"http://{NAME}:{port}/hook"
        with Session(engine) as s:
            tenant = ensure_tenant(session=s, name="rebind")
            assert tenant.id is not None
            ep = WebhookEndpoint(tenant_id=tenant.id, url=webhooks.check_url(url, settings),
                                 secret="whsec_" + base64.b64encode(os.urandom(24)).decode())
            s.add(ep)
            s.flush()
            d = WebhookDelivery(endpoint_id=ep.id, tenant_id=tenant.id, event_type="fine_tuning.job.succeeded",
                                job_id="ftjob-rebind", body='{"object":"event"}')
            s.add(d)
            s.commit()
            report["delivery_id"] = d.id

        checked_by_gateway = webhooks.dial_addresses

        def check_then_rebind(url: str, settings: Settings) -> list[Any]:
            addrs = checked_by_gateway(url, settings)
            report["checked"] = [str(a) for a in addrs]
            hosts.write_text(f"127.0.0.1 {NAME}\n")
            os.kill(dns.pid, signal.SIGHUP)                      # dnsmasq rereads its hosts, drops its cache
            report["resolver_after_check"] = _wait_for(["127.0.0.1"])
            return addrs

        webhooks.dial_addresses = check_then_rebind             # type: ignore[assignment]
        try:
            webhooks.deliver_due(engine, settings)
        finally:
            webhooks.dial_addresses = checked_by_gateway         # type: ignore[assignment]
        with Session(engine) as s:
            row = s.get(WebhookDelivery, report["delivery_id"])
            assert row is not None
            report["first_try"] = {"last_status": row.last_status, "last_error": row.last_error}

        naive = httpx.post(url, headers={"x-probe": "naive"}, content=b"{}", timeout=5)   # resolves again
        report["naive_client_reached_loopback"] = naive.status_code == 200

        webhooks.deliver_due(engine, settings)                  # the name now answers 127.0.0.1
        with Session(engine) as s:
            row = s.get(WebhookDelivery, report["delivery_id"])
            assert row is not None
            report["delivery"] = {"status": row.status, "attempts": row.attempts, "last_status": row.last_status,
                                  "last_error": row.last_error}
        report["public_got"] = public.got
        report["loopback_got"] = [{"probe": h.get("x-probe"), "webhook_id": h.get("webhook-id")}
                                  for h, _, _ in loopback.got]
        engine.dispose()
        return report
    finally:
        loopback.close()
        public.server.shutdown()
        dns.terminate()
        dns.wait(10)


if __name__ == "__main__":
    print(json.dumps(_scenario(Path(sys.argv[1]))))
