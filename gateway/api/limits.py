"""Request body caps: an ASGI middleware answering 413 (OpenAI error body) for an oversized body.

Every request body is capped at ``Settings.max_json_bytes`` (JSON, urlencoded or multipart
forms alike) except the two streaming uploads (``POST /v1/files``, ``POST /portal/datasets``):
those cap the file at ``max_upload_bytes`` and each non-file field themselves
(gateway/datasets/uploads.py), while the bytes arrive.

Cheap by construction, since the API's hot path passes through here:

* a request without a body (no Content-Length, no Transfer-Encoding: every GET) is handed on
  untouched;
* a declared Content-Length over the cap is refused before the app runs; one within the cap is
  handed on untouched too: the HTTP server frames the body by it, so it cannot grow past it;
* only a body of unknown length (``Transfer-Encoding: chunked``) is counted as it streams,
  through one small object per request; past the cap it answers 413 itself (if the app has not
  started a response), tells the app the client is gone, and drops whatever the app sends after.

The 413 closes the connection (``Connection: close``), so the server does not go on reading a
body nobody wants. The refusal's body is encoded once, per middleware.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import error_body

# The routes whose multipart body is streamed and capped by gateway/datasets/uploads.py (POST only).
UPLOAD_PATHS = frozenset({"/v1/files", "/portal/datasets"})
CODE = "request_too_large"
SCOPE_FLAG = "sft.body_too_large"   # set in the scope once a streamed body went over the cap


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413, except the streaming uploads."""

    def __init__(self, app: ASGIApp, max_bytes: int, upload_paths: frozenset[str] = UPLOAD_PATHS):
        if max_bytes < 1:
            raise ValueError(f"max_json_bytes must be positive, got {max_bytes}")
        self.app, self.max_bytes, self.upload_paths = app, max_bytes, upload_paths

        body = json.dumps(error_body(
            f"the request body is over the {max_bytes}-byte limit for JSON and form requests "
            "(upload datasets as multipart to POST /v1/files)",
            type_="invalid_request_error", code=CODE)).encode()
        self._headers = ((b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close"))
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "POST" and scope["path"] in self.upload_paths):
            await self.app(scope, receive, send)
            return
        length, chunked = None, False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
        if length is not None and not (length.isdigit() and int(length) <= self.max_bytes):
            await self.refuse(send)   # over the cap (a length that is no number never gets this far)
            return
        if chunked:
            await _Counted(self, scope, receive, send).run()
            return
        await self.app(scope, receive, send)

    async def refuse(self, send: Send) -> None:
        """Answer 413 with the JSON error body (``request_too_large``)."""
        # fresh messages: a middleware further out may edit a message's headers in place
        await send({"type": "http.response.start", "status": 413, "headers": list(self._headers)})
        await send({"type": "http.response.body", "body": self._body})


class _Counted:
    """One request whose body length is unknown up front: count it while the app reads it."""

    __slots__ = ("limit", "scope", "receive", "send", "seen", "started", "over", "answered")

    def __init__(self, limit: BodyLimit, scope: Scope, receive: Receive, send: Send):
        self.limit, self.scope, self.receive, self.send = limit, scope, receive, send
        self.seen = 0
        self.started = self.over = self.answered = False

    async def run(self) -> None:
        await self.limit.app(self.scope, self._receive, self._send)

    async def _receive(self) -> Message:
        if self.over:
            return {"type": "http.disconnect"}
        message = await self.receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit.max_bytes:
                self.over = True
                self.scope[SCOPE_FLAG] = True
                if not self.started:
                    self.started = self.answered = True
                    await self.limit.refuse(self.send)
                return {"type": "http.disconnect"}   # the app stops reading, as for a client gone away
        return message

    async def _send(self, message: Message) -> None:
        if self.answered:
            return       # the 413 went out instead of whatever the app answers now
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)
