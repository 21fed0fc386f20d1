"""Dataset files: stored content-addressed in the tenant's storage, owned by its unix user."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from gateway.access.tokens import Principal, who
from gateway.config import Settings
from gateway.datasets.tokencount import counter_for
from gateway.datasets.validation import Validator
from gateway.errors import Conflict, Forbidden, NotFound, ServiceError
from gateway.models import DataFile, FileStatus, FineTuningJob, utcnow
from gateway.state import ACTIVE, JobState
from gateway.storage import TenantStorage, layout, storage_for

if TYPE_CHECKING:
    from gateway.datasets.uploads import Upload

log = logging.getLogger(__name__)
ACTIVE_JOB_STATES = tuple(s.value for s in JobState if s in ACTIVE)


def _tenant(principal: Principal) -> tuple[int, str]:
    if principal.tenant_id is None or principal.tenant_name is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    return principal.tenant_id, principal.tenant_name


def tenant_storage(settings: Settings, principal: Principal) -> TenantStorage:
    """The tenant's storage verbs (see gateway.storage)."""
    _, name = _tenant(principal)
    return storage_for(settings).tenant(name)


def file_parts(row: DataFile) -> layout.Parts:
    """Where a file row's bytes are, as layout components (checked)."""
    return layout.result_file(row.path) if row.path else layout.dataset(row.sha256)


def stream_file(settings: Settings, tenant_name: str, row: DataFile) -> Iterator[bytes]:
    """The bytes of ``row``, opened by the broker as the tenant: a regular file of the tenant's,
    exactly ``row.bytes`` long, else a clear error and not one byte."""
    return storage_for(settings).tenant(tenant_name).stream(file_parts(row), row.bytes)


def upload_validator(settings: Settings, model: str | None) -> Validator:
    """The streaming validator for an upload, with ``model``'s tokenizer when it has one."""
    return Validator(max_seq_len=settings.max_seq_len, min_examples=settings.min_examples,
                     max_errors=settings.max_reported_errors, max_line_bytes=settings.max_line_bytes,
                     counter=counter_for(settings.models_root, model))


def _summary(report: dict[str, Any]) -> str | None:
    if report["ok"]:
        return None
    counts = ", ".join(f"{k}: {n}" for k, n in sorted(report["error_counts"].items()))
    first = report["errors"][0] if report["errors"] else None
    where = f" (first: line {first['line']}: {first['message']})" if first and first["line"] else ""
    return f"validation failed: {counts}{where}"[:2000]


EXPIRES_ANCHOR, EXPIRES_SECONDS = "expires_after[anchor]", "expires_after[seconds]"
"""OpenAI's ``expires_after`` as multipart form fields (what its clients send for the object)."""


def expires_after(settings: Settings, fields: dict[str, str]) -> int | None:
    """The seconds after its creation an upload with these form ``fields`` expires: ``expires_after[seconds]``,
    counted from ``expires_after[anchor]``, which is ``created_at`` (OpenAI's only anchor, so also what a
    missing anchor means); None without ``expires_after``. ServiceError (400, ``param`` expires_after) for
    another anchor, an anchor without seconds, or seconds that are not an integer within
    ``file_expiry_min_s``..``file_expiry_max_s``."""
    anchor, seconds = fields.get(EXPIRES_ANCHOR), fields.get(EXPIRES_SECONDS)
    if anchor is None and seconds is None:
        return None
    if seconds is None:
        raise ServiceError("expires_after[anchor] without expires_after[seconds]: send both (or neither)",
                           param="expires_after")
    if anchor is not None and anchor != "created_at":
        raise ServiceError(f"expires_after[anchor] must be 'created_at', not {anchor!r}", param="expires_after")
    low, high = settings.file_expiry_min_s, settings.file_expiry_max_s
    raw = (seconds or "").strip()
    if not (raw.isascii() and raw.isdigit() and low <= int(raw) <= high):
        raise ServiceError(f"expires_after[seconds] must be an integer from {low} to {high} "
                           f"(seconds after the upload), not {seconds!r}", param="expires_after")
    return int(raw)


def store_upload(*, session: Session, settings: Settings, principal: Principal, upload: Upload,
                 model: str | None, expires_after_s: int | None = None) -> DataFile:
    """Name an uploaded temp file by its sha256 (broker ``upload_commit``) and record it.

    An identical live upload of the same tenant, validated with the same model's tokenizer, that never
    expires is returned instead (deduplicated) when this one does not expire either; one that expires
    (``expires_after_s`` after its ``created_at``) is a row of its own over the same bytes, which stay
    while any live row names them. The status is
    ``processed`` when validation passed, else ``error``.
    """
    tenant_id, tenant_name = _tenant(principal)
    assert upload.stored is not None and upload.store is not None and upload.report is not None
    report = upload.report
    try:
        upload.store.upload_commit(upload.stored, upload.sha256, upload.size)
    except BaseException:
        upload.discard()
        raise
    upload.close_fd()
    upload.stored = None
    # the same bytes validated with the same model's tokenizer: the same file; with another model's,
    # a row of its own (its token counts and length checks are that model's: issue 35)
    same_model = col(DataFile.model).is_(None) if model is None else DataFile.model == model
    existing = None if expires_after_s is not None else session.exec(select(DataFile).where(
        DataFile.tenant_id == tenant_id, DataFile.sha256 == upload.sha256, col(DataFile.path).is_(None),
        col(DataFile.deleted_at).is_(None), col(DataFile.expires_at).is_(None), same_model)).first()
    if existing is not None:
        return existing
    row = DataFile(tenant_id=tenant_id, filename=upload.filename or "upload.jsonl", bytes=upload.size,
                   sha256=upload.sha256,
                   status=FileStatus.PROCESSED if report["ok"] else FileStatus.ERROR,
                   status_details=_summary(report), model=model, validation=report, created_by=who(principal))
    if expires_after_s is not None:
        row.expires_at = row.created_at + timedelta(seconds=expires_after_s)
    session.add(row)
    session.flush()
    log.info("file %s stored for tenant %s: %d bytes, status %s%s", row.id, tenant_name, upload.size,
             row.status, f", expires {row.expires_at.isoformat(timespec='seconds')}" if row.expires_at else "")
    return row


def list_files(*, session: Session, principal: Principal, purpose: str | None = None,
               after: str | None = None, limit: int = 10000, order: str = "desc") -> tuple[list[DataFile], bool]:
    """The tenant's live files, newest first by default; (page, has_more)."""
    tenant_id, _ = _tenant(principal)
    q = select(DataFile).where(DataFile.tenant_id == tenant_id, col(DataFile.deleted_at).is_(None))
    if purpose:
        q = q.where(DataFile.purpose == purpose)
    key = (col(DataFile.created_at).desc(), col(DataFile.id).desc()) if order == "desc" \
        else (col(DataFile.created_at).asc(), col(DataFile.id).asc())
    rows = list(session.exec(q.order_by(*key)))
    if after:
        ids = [r.id for r in rows]
        rows = rows[ids.index(after) + 1:] if after in ids else []
    return rows[:limit], len(rows) > limit


def get_file(*, session: Session, principal: Principal, file_id: str) -> DataFile:
    """The tenant's live file ``file_id``; NotFound for a missing or foreign one alike."""
    tenant_id, _ = _tenant(principal)
    # scoped in SQL: a foreign row is never loaded, so "foreign" costs exactly what "missing" does
    row = session.exec(select(DataFile).where(DataFile.id == file_id, DataFile.tenant_id == tenant_id,
                                              col(DataFile.deleted_at).is_(None))).first() \
        if len(file_id) <= 40 else None
    if row is None:
        raise NotFound(f"no such file: {file_id}", param="file_id")
    return row


def delete_file(*, session: Session, settings: Settings, principal: Principal, file_id: str) -> None:
    """Delete a file and its bytes. Conflict (409) while a job that uses it is not finished."""
    row = get_file(session=session, principal=principal, file_id=file_id)
    busy = session.exec(select(FineTuningJob.id).where(
        (FineTuningJob.training_file == file_id) | (FineTuningJob.validation_file == file_id),
        col(FineTuningJob.status).in_(ACTIVE_JOB_STATES))).first()
    if busy:
        raise Conflict(f"file {file_id} is used by job {busy}, which has not finished; "
                       "cancel it or wait for it to end", code="file_in_use")
    row.deleted_at = utcnow()
    session.add(row)
    session.flush()
    _, tenant_name = _tenant(principal)
    still_used = session.exec(select(DataFile.id).where(
        DataFile.tenant_id == row.tenant_id, DataFile.sha256 == row.sha256,
        col(DataFile.path).is_(None), col(DataFile.deleted_at).is_(None))).first()
    if row.path or not still_used:
        storage_for(settings).tenant(tenant_name).remove([file_parts(row)])
