"""Dataset files: stored content-addressed in the tenant's storage, owned by its unix user."""

from __future__ import annotations

import logging
import os
import pwd
from pathlib import Path
from typing import Any

from sqlmodel import Session, col, select

from gateway.config import Settings
from gateway.models import DataFile, FileStatus, FineTuningJob, utcnow
from gateway.services import Conflict, Forbidden, NotFound
from gateway.services.tokens import Principal
from gateway.validation import Validator

log = logging.getLogger(__name__)
ACTIVE_JOB_STATES = ("validating_files", "queued", "running", "publishing", "cancelling")


def _tenant(principal: Principal) -> tuple[int, str]:
    if principal.tenant_id is None or principal.tenant_name is None:
        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    return principal.tenant_id, principal.tenant_name


def _owner(unix_user: str | None) -> tuple[int, int] | None:
    """(uid, gid) to own tenant files; None when not root or the user does not exist."""
    if os.geteuid() != 0 or not unix_user:
        return None
    try:
        pw = pwd.getpwnam(unix_user)
    except KeyError:
        log.warning("unix user %s does not exist: files stay owned by the gateway", unix_user)
        return None
    return pw.pw_uid, pw.pw_gid


def dataset_dir(settings: Settings, principal: Principal) -> Path:
    """The tenant's datasets dir (0700, tenant-owned), created if needed."""
    _, name = _tenant(principal)
    d = settings.tenant_dir(name) / "datasets"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = _owner(principal.unix_user)
    if owner:
        os.chown(d, *owner)
    return d


def file_path(settings: Settings, tenant_name: str, row: DataFile) -> Path:
    if row.path:   # result files: relative to the tenant dir
        return settings.tenant_dir(tenant_name) / row.path
    return settings.tenant_dir(tenant_name) / "datasets" / f"{row.sha256}.jsonl"


def upload_validator(settings: Settings, model: str | None) -> Validator:
    """The streaming validator for an upload, with ``model``'s tokenizer when it has one."""
    from gateway.tokencount import counter_for

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


def store_upload(*, session: Session, settings: Settings, principal: Principal, filename: str,
                 tmp_path: Path, sha256: str, size: int, report: dict[str, Any],
                 model: str | None) -> DataFile:
    """Publish an uploaded temp file under its sha256 and record it.

    An identical live upload of the same tenant is returned instead (deduplicated).
    The status is ``processed`` when validation passed, else ``error``.
    """
    tenant_id, tenant_name = _tenant(principal)
    existing = session.exec(select(DataFile).where(
        DataFile.tenant_id == tenant_id, DataFile.sha256 == sha256, col(DataFile.path).is_(None),
        col(DataFile.deleted_at).is_(None))).first()
    final = tmp_path.parent / f"{sha256}.jsonl"
    if existing is not None and final.exists():
        tmp_path.unlink(missing_ok=True)
        return existing
    owner = _owner(principal.unix_user)
    if owner:
        os.chown(tmp_path, *owner)
    os.chmod(tmp_path, 0o600)
    os.replace(tmp_path, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    row = DataFile(tenant_id=tenant_id, filename=filename, bytes=size, sha256=sha256,
                   status=FileStatus.PROCESSED if report["ok"] else FileStatus.ERROR,
                   status_details=_summary(report), model=model, validation=report)
    session.add(row)
    session.flush()
    log.info("file %s stored for tenant %s: %d bytes, status %s", row.id, tenant_name, size,
             row.status)
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
        file_path(settings, tenant_name, row).unlink(missing_ok=True)
