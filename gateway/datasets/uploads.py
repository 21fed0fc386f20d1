"""Receive a multipart upload as a stream: bytes go to a temp file in the tenant's
storage while they are hashed, counted against the limit and validated line by line.

The temp file is created by the storage broker as the tenant (``upload_begin``) and
only its file descriptor comes here: the gateway never opens a path in tenant
storage. Nothing is buffered whole in memory; a body over the limit is cut off at
the limit and its temp file removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.datasets.validation import LineSplitter, Validator
from gateway.errors import QuotaExceeded, ServiceError, StorageFull, TooLarge
from gateway.storage import QUOTA_EXCEEDED, STORAGE_FULL, TenantStorage
from gateway.storage import Upload as StoredUpload

MAX_FIELD_BYTES = 1024
FILE_FIELD = "file"


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    stored: StoredUpload | None = None     # the temp file in the tenant's storage (its fd, its name)
    store: TenantStorage | None = None
    size: int = 0
    sha256: str = ""
    report: dict[str, Any] | None = None

    def close_fd(self) -> None:
        """Close the temp file's fd, once (its file stays)."""
        if self.stored is not None and self.stored.fd >= 0:
            os.close(self.stored.fd)
            self.stored.fd = -1

    def discard(self) -> None:
        """Close the fd and remove the temp file; a failed removal is left to the storage sweep."""
        self.close_fd()
        if self.stored is not None and self.store is not None:
            try:
                self.store.upload_abort(self.stored)
            except ServiceError:
                pass     # the sweep removes it later
            self.stored = None


def clean_filename(raw: bytes) -> str:
    """A display name only (never a path): last path component, printable, <= 255 chars."""
    name = raw.decode("utf-8", errors="replace").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip() or "upload.jsonl"
    return name[:255]


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a filling disk) without raising: loop, so a full disk
    surfaces as ENOSPC instead of a silently truncated file whose sha256 covers bytes never stored."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Receiver:
    def __init__(self, store: TenantStorage, limit: int, make_validator: Callable[[dict[str, str]], Validator]):
        self.store, self.limit, self.make_validator = store, limit, make_validator
        self.up = Upload(store=store)
        self.headers: dict[bytes, bytes] = {}
        self.hname = b""
        self.hvalue = b""
        self.part: str | None = None
        self.value = bytearray()
        self.fd = -1
        self.hasher = hashlib.sha256()
        self.splitter: LineSplitter | None = None
        self.file_done = False
        self.ended = False

    # python-multipart callbacks ------------------------------------------
    def on_part_begin(self) -> None:
        self.headers, self.part = {}, None

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.hname += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.hvalue += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self.hname.lower()] = self.hvalue
        self.hname, self.hvalue = b"", b""

    def on_headers_finished(self) -> None:
        _, params = parse_options_header(self.headers.get(b"content-disposition", b""))
        self.part = params.get(b"name", b"").decode("utf-8", errors="replace")
        if self.part == FILE_FIELD:
            if self.up.stored is not None:
                raise ServiceError("more than one `file` part in the upload", param="file")
            self.up.filename = clean_filename(params.get(b"filename", b"upload.jsonl"))
            self.up.stored = self.store.upload_begin()
            self.fd = self.up.stored.fd
            self.splitter = LineSplitter(self.make_validator(self.up.fields))
        else:
            self.value = bytearray()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.part != FILE_FIELD:
            self.value += chunk
            if len(self.value) > MAX_FIELD_BYTES:
                raise TooLarge(f"form field {self.part!r} is longer than {MAX_FIELD_BYTES} bytes",
                               param=self.part, code="request_too_large")
            return
        self.up.size += len(chunk)
        if self.up.size > self.limit:
            raise TooLarge(f"the file exceeds the upload limit of {self.limit} bytes; it was cut "
                           "off and nothing was kept", param="file")
        _write_all(self.fd, chunk)
        self.hasher.update(chunk)
        assert self.splitter is not None
        self.splitter.feed(chunk)

    def on_part_end(self) -> None:
        if self.part == FILE_FIELD:
            os.fsync(self.fd)
            self.file_done = True
        elif self.part:
            self.up.fields[self.part] = self.value.decode("utf-8", errors="replace")

    def on_end(self) -> None:
        self.ended = True

    def callbacks(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "on_part_begin", "on_header_field", "on_header_value", "on_header_end",
            "on_headers_finished", "on_part_data", "on_part_end", "on_end")}


async def receive(stream: AsyncIterator[bytes], content_type: str, *, store: TenantStorage,
                  limit: int, make_validator: Callable[[dict[str, str]], Validator]) -> Upload:
    """Parse a multipart body from ``stream`` into a temp file of ``store``. Raises
    ServiceError (400/413/415); on any error the temp file is gone. The caller commits the
    returned upload (``services.files.store_upload``) or discards it."""
    ctype, params = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise ServiceError("send the file as multipart/form-data (fields: file, purpose)",
                           code="unsupported_media_type")
    rx = _Receiver(store, limit, make_validator)
    parser = MultipartParser(params[b"boundary"], rx.callbacks())  # type: ignore[arg-type]
    try:
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
        if not rx.ended or (rx.up.stored is not None and not rx.file_done):
            raise ServiceError("the multipart body is truncated")
    except ServiceError:
        _abort(rx)
        raise
    except OSError as e:    # the temp file could not be written: say so, not "malformed"
        _abort(rx)
        if e.errno == errno.EDQUOT:
            raise QuotaExceeded(QUOTA_EXCEEDED.replace("nothing was kept", "the upload was not kept")) from e
        if e.errno == errno.ENOSPC:
            raise StorageFull(STORAGE_FULL.replace("nothing was kept", "the upload was not kept")) from e
        raise
    except Exception as e:  # python-multipart's parse errors, client disconnects
        _abort(rx)
        raise ServiceError(f"malformed multipart body: {type(e).__name__}") from e
    if rx.up.stored is None:
        raise ServiceError("no `file` part in the upload", param="file")
    assert rx.splitter is not None
    rx.up.sha256 = rx.hasher.hexdigest()
    try:
        rx.up.report = rx.splitter.finish()   # token counting runs here: it must not leak the temp file
    except BaseException:
        _abort(rx)
        raise
    return rx.up


def _abort(rx: _Receiver) -> None:
    rx.fd = -1
    rx.up.discard()
