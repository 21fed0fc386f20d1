"""Request body caps (gateway/api/limits.py) against the real app: TestClient and a live uvicorn.

Every body but the two streaming uploads is capped at ``max_json_bytes``: by Content-Length
before the app runs, and by counting a chunked body as it arrives. Over the cap: 413 with
the OpenAI error body (code ``request_too_large``). The uploads stream past it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from gateway.config import Settings
from gateway.models import DataFile, FineTuningJob
from tests.service.conftest import (
    TENANT_A,
    Gateway,
    _free_port,
    chat_lines,
    onboard_storage,
    tenant_storage_root,
    wait_port,
)

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]
CAP = 1024 * 1024          # the default max_json_bytes
EXPECTED = {"type": "invalid_request_error", "param": None, "code": "request_too_large"}


def too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert {k: err[k] for k in EXPECTED} == EXPECTED and f"{CAP}-byte limit" in err["message"]
    assert r.headers["connection"] == "close"


def job_body(size: int) -> bytes:
    """A fine-tuning job request padded (in ``metadata``) to exactly ``size`` bytes."""
    head = b'{"model":"tiny-chat","training_file":"file-nope","metadata":{"pad":"'
    tail = b'"}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    while total > 0:
        yield b" " * min(size, total)
        total -= size


def rows(gw: Gateway, model: type[Any]) -> int:
    with Session(gw.app.state.engine) as s:
        return int(s.exec(select(func.count()).select_from(model)).one())


def big_dataset(min_bytes: int) -> bytes:
    data = chat_lines(10)
    line = json.dumps({"messages": [{"role": "user", "content": "q " * 200},
                                    {"role": "assistant", "content": "a " * 200}]}).encode() + b"\n"
    return data + line * (min_bytes // len(line) + 1)


@pytest.fixture
def gw(tmp_path: Path, storage_root: Path) -> Iterator[Gateway]:
    g = Gateway(Settings(storage_root=storage_root, database_url=f"sqlite:///{tmp_path / 'gw.db'}",
                         default_model=None, max_upload_bytes=8 * 1024 * 1024, max_line_bytes=1024 * 1024))
    assert g.settings.max_json_bytes == CAP
    yield g
    g.app.state.engine.dispose()


def portal_client(gw: Gateway, token: str) -> tuple[TestClient, str]:
    """A signed-in portal client and its session's CSRF token."""
    c = TestClient(gw.app, raise_server_exceptions=False)
    m = re.search(r'name="csrf" value="([^"]+)"', c.get("/portal/login").text)
    assert m
    r = c.post("/portal/login", data={"token": token, "csrf": m.group(1)}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = c.get("/portal/datasets")
    m = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert page.status_code == 200 and m
    return c, m.group(1)


# ----------------------------------------------------------------- TestClient
def test_json_over_the_cap_by_content_length_is_413_before_the_route_runs(gw: Gateway) -> None:
    url, auth = "/v1/fine_tuning/jobs", gw.auth(TENANT_A)
    r = gw.client.post(url, content=job_body(CAP + 1), headers={**auth, "content-type": "application/json"})
    too_large(r)
    # the same request without its token is refused the same way: the cap comes before the route
    too_large(gw.client.post(url, content=job_body(CAP + 1), headers={"content-type": "application/json"}))
    # exactly at the cap the route runs (and refuses the unknown file, not the size)
    r = gw.client.post(url, content=job_body(CAP), headers={**auth, "content-type": "application/json"})
    assert r.status_code in (400, 404) and r.json()["error"]["code"] != "request_too_large", r.text[:300]
    assert rows(gw, FineTuningJob) == 0


def test_chunked_json_is_counted_while_it_streams(gw: Gateway) -> None:
    url, auth = "/v1/fine_tuning/jobs", {**gw.auth(TENANT_A), "content-type": "application/json"}
    r = gw.client.post(url, content=chunks(CAP + 1), headers=auth)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    too_large(r)
    r = gw.client.post(url, content=chunks(20 * CAP), headers=auth)
    too_large(r)
    # a chunked body within the cap reaches the route (then it is just bad JSON)
    body = job_body(CAP)
    r = gw.client.post(url, content=iter([body[:1000], body[1000:]]), headers=auth)
    assert r.status_code in (400, 404) and r.json()["error"]["code"] != "request_too_large", r.text[:300]
    assert rows(gw, FineTuningJob) == 0


def test_any_other_route_and_method_is_capped_multipart_included(gw: Gateway) -> None:
    auth = gw.auth(TENANT_A)
    too_large(gw.client.request("DELETE", "/v1/files/file-x", content=b"x" * (CAP + 1), headers=auth))
    too_large(gw.client.request("GET", "/v1/files", content=b"x" * (CAP + 1), headers=auth))
    # multipart is exempt only on the upload routes
    too_large(gw.client.post("/v1/fine_tuning/jobs", headers=auth, files={"file": ("a.jsonl", b"x" * (CAP + 1))}))
    too_large(gw.client.put("/v1/files", headers=auth, files={"file": ("a.jsonl", b"x" * (CAP + 1))}))
    assert gw.client.get("/v1/files", headers=auth).status_code == 200      # no body: untouched
    assert gw.client.get("/healthz").json() == {"status": "ok"}


def test_uploads_stream_past_the_cap_on_both_upload_routes(gw: Gateway) -> None:
    data = big_dataset(2 * CAP)
    assert len(data) > 2 * CAP
    r = gw.upload(TENANT_A, data)
    assert r.status_code == 200 and r.json()["bytes"] == len(data), r.text[:300]
    c, csrf = portal_client(gw, gw.tokens[TENANT_A])
    r = c.post("/portal/datasets", data={"csrf": csrf}, files={"file": ("big.jsonl", data + b"\n")},
               follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/portal/datasets/file-"), r.text[:300]
    assert rows(gw, DataFile) == 2
    # the upload route's own limit still holds (max_upload_bytes: 8 MiB)
    r = gw.upload(TENANT_A, b"x" * (9 * 1024 * 1024))
    assert r.status_code == 413 and r.json()["error"]["code"] != "request_too_large"


def test_portal_forms_are_capped(gw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    c, csrf = portal_client(gw, gw.tokens[TENANT_A])
    # the sign-in form (urlencoded), by Content-Length and chunked
    too_large(c.post("/portal/login", data={"token": "x" * (CAP + 1), "csrf": "y"}, follow_redirects=False))
    form = b"csrf=" + csrf.encode() + b"&pad=" + b"x" * CAP
    ctype = {"content-type": "application/x-www-form-urlencoded"}
    too_large(c.post("/portal/logout", content=iter([form[:10], form[10:]]), headers=ctype, follow_redirects=False))
    # the job form reads request.form() itself: cut off mid-stream, the page logs no error
    too_large(c.post("/portal/jobs", content=chunks(CAP + 1), headers=ctype, follow_redirects=False))
    assert not [r for r in caplog.records if r.name == "gateway.portal"], caplog.text
    # still signed in: the refused sign-out did not run
    assert c.get("/portal/datasets", follow_redirects=False).status_code == 200
    r = c.post("/portal/logout", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and "signed_out" in r.headers["location"]


def test_portal_page_that_cannot_parse_its_body_shows_an_error_page(gw: Gateway,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """FastAPI's own 400 for an unparsable form is a 400 page, not a logged 500."""
    c, _ = portal_client(gw, gw.tokens[TENANT_A])
    r = c.post("/portal/logout", content=b"--x\r\nbroken", follow_redirects=False,
               headers={"content-type": "multipart/form-data"})     # no boundary
    assert r.status_code == 400 and "text/html" in r.headers["content-type"], (r.status_code, r.text[:300])
    assert "boundary" in r.text.lower()
    assert not [r for r in caplog.records if r.name == "gateway.portal"], caplog.text


# ----------------------------------------------------------------- live uvicorn
class Uvicorn:
    """``uvicorn gateway.app:worker_app --factory`` on a fresh SQLite database."""

    def __init__(self, tmp: Path):
        self._storage = tenant_storage_root()
        storage = next(self._storage)
        onboard_storage(storage, TENANT_A)
        self.port = _free_port()
        self.env = {**os.environ, "SFT_DATABASE_URL": f"sqlite:///{tmp / 'gw.db'}", "SFT_STORAGE_ROOT": str(storage),
                    "SFT_DEFAULT_MODEL": ""}
        from gateway.access.tokens import create_token
        from gateway.db import make_engine, migrate
        from gateway.models import Role
        from gateway.services.tenants import ensure_tenant

        engine = make_engine(self.env["SFT_DATABASE_URL"])
        migrate(engine)
        with Session(engine) as s:
            self.token, _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=TENANT_A))
            s.commit()
        engine.dispose()
        self.log = open(tmp / "uvicorn.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "gateway.app:worker_app", "--factory",
                                      "--port", str(self.port), "--log-level", "warning"],
                                     cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, 60)

    def raw(self, head: str, body: Iterable[bytes] = ()) -> tuple[bytes, int]:
        """Send a raw request (head, then ``body`` piece by piece while the server reads);
        return (the whole answer up to the server's close, the body bytes it took)."""
        sent = 0
        with socket.create_connection(("127.0.0.1", self.port), timeout=20) as s:
            s.sendall(head.encode())
            try:
                for piece in body:
                    s.sendall(piece)
                    sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = b""
            try:
                while chunk := s.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        return answer, sent

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()
        self._storage.close()      # removes the storage root


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    tmp = tmp_path_factory.mktemp("limits")
    os.chmod(tmp, 0o755)
    server = Uvicorn(tmp)
    yield server
    server.stop()


def _answer(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _chunked(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    for piece in chunks(total, size):
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"


def test_live_content_length_over_the_cap_is_answered_before_the_body_is_sent(live: Uvicorn) -> None:
    head = (f"POST /v1/fine_tuning/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {100 * CAP}\r\nExpect: 100-continue\r\n\r\n")
    t0 = time.monotonic()
    raw, _ = live.raw(head)       # no body at all: the answer comes anyway, and no "100 Continue"
    status, headers, body = _answer(raw)
    assert status == 413 and headers["connection"] == "close", raw[:500]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 10


def test_live_chunked_body_is_cut_off_at_the_cap(live: Uvicorn) -> None:
    head = (f"POST /v1/fine_tuning/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.token}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    raw, sent = live.raw(head, _chunked(CAP + 1))       # one byte over, no closing chunk
    status, headers, body = _answer(raw)
    assert status == 413 and headers["connection"] == "close", raw[:500]
    assert json.loads(body)["error"] == {**EXPECTED, "message": json.loads(body)["error"]["message"]}
    assert sent > CAP
    # within the cap (closing chunk sent) the route answers
    small = job_body(4096)
    raw, _ = live.raw(head, iter([f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"]))
    assert _answer(raw)[0] in (400, 404), raw[:500]


def test_live_endless_chunked_body_from_httpx(live: Uvicorn) -> None:
    """An httpx client streaming far more than the cap gets the 413 (the server stops reading)."""
    def endless() -> Iterator[bytes]:
        while True:
            yield b" " * 65536

    with httpx.Client(base_url=f"http://127.0.0.1:{live.port}", timeout=30) as c:
        r = c.post("/v1/fine_tuning/jobs", content=endless(),
                   headers={"Authorization": f"Bearer {live.token}", "Content-Type": "application/json"})
        too_large(r)
        # the API still answers (a new connection: the refused one was closed)
        assert c.get("/v1/files", headers={"Authorization": f"Bearer {live.token}"}).status_code == 200


def test_live_upload_and_portal_form(live: Uvicorn) -> None:
    auth = {"Authorization": f"Bearer {live.token}"}
    base = f"http://127.0.0.1:{live.port}"
    data = big_dataset(2 * CAP)
    r = httpx.post(base + "/v1/files", headers=auth, data={"purpose": "fine-tune"},
                   files={"file": ("big.jsonl", data)}, timeout=60)
    assert r.status_code == 200 and r.json()["bytes"] == len(data), r.text[:300]
    with httpx.Client(base_url=base, timeout=30) as c:
        m = re.search(r'name="csrf" value="([^"]+)"', c.get("/portal/login").text)
        assert m
        too_large(c.post("/portal/login", data={"token": live.token, "csrf": m.group(1), "pad": "x" * CAP}))
        r = c.post("/portal/login", data={"token": live.token, "csrf": m.group(1)})
        assert r.status_code == 303 and r.headers["location"] == "/portal/jobs"
    log = Path(live.log.name).read_text()
    assert "Traceback" not in log, log[-3000:]
