"""A write is committed before its response leaves: a client that reads its 200 (or follows a 303) and
asks again sees what it wrote. FastAPI's default closes a yield dependency only after the response was
sent; the hostile tier's landing CI caught an upload whose 200 came before its row (stop 25)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from fastapi.dependencies.models import Dependant
from sqlmodel import Session, select

from gateway.api.deps import get_session
from gateway.models import DataFile
from tests.service.conftest import TENANT_A, Gateway, chat_lines

pytestmark = pytest.mark.service


def _asgi(app: Any, method: str, path: str, headers: dict[str, str], body: bytes,
          on_start: Any) -> list[dict[str, Any]]:
    """Drive ``app`` over raw ASGI, calling ``on_start`` the moment the response's status goes out."""
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()            # the client stays connected
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                on_start(message)
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "server": ("testserver", 80), "client": ("127.0.0.1", 5000),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
                 "state": {}}
        await app(scope, receive, send)

    # a thread of its own: under the full suite this thread may already run an event loop
    worker = threading.Thread(target=lambda: asyncio.run(run()))
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the app did not answer"
    return sent


def test_an_uploaded_file_is_in_the_database_when_its_200_starts(gw: Gateway) -> None:
    """The upload route writes through the request session alone (no commit of its own)."""
    seen: list[int] = []

    def on_start(message: dict[str, Any]) -> None:
        with Session(gw.app.state.engine) as s:          # another connection: only committed rows
            seen.append(len(s.exec(select(DataFile)).all()))

    req = httpx.Request("POST", "http://testserver/v1/files", headers=gw.auth(TENANT_A),
                        data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", chat_lines(12), "application/jsonl")})
    body = req.read()
    sent = _asgi(gw.app, "POST", "/v1/files", dict(req.headers), body, on_start)
    assert sent[0]["status"] == 200, sent
    assert seen == [1]


def _session_scopes(dependant: Dependant) -> list[str | None]:
    found = [dependant.scope] if dependant.call is get_session else []
    for sub in dependant.dependencies:
        found += _session_scopes(sub)
    return found


def _routes(routes: list[Any]) -> list[Any]:
    out = []
    for r in routes:
        if hasattr(r, "original_router"):     # FastAPI >= 0.16x keeps included routers whole
            out += _routes(r.original_router.routes)
        elif hasattr(r, "dependant"):
            out.append(r)
    return out


def test_every_route_commits_before_it_answers(gw: Gateway) -> None:
    """No route, API or portal, takes the request session with FastAPI's after-the-response scope."""
    scopes = {(tuple(r.methods), r.path): _session_scopes(r.dependant) for r in _routes(gw.app.routes)}
    assert sum(len(s) for s in scopes.values()) > 50
    late = {path: s for path, s in scopes.items() if any(x != "function" for x in s)}
    assert late == {}
