"""Dataset pages: list, upload (streamed, with a progress bar), validation report, delete, download."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from gateway.access.policy import Policy
from gateway.api.deps import SessionDep, SettingsDep
from gateway.config import Settings
from gateway.datasets.uploads import receive
from gateway.datasets.validation import Validator
from gateway.errors import ServiceError, TooLarge
from gateway.models import DataFile
from gateway.portal.session import CSRF_FIELD, CSRF_HEADER, check_csrf
from gateway.portal.web import PortalRoute, UserDep, portal_access, render, wants_json
from gateway.services import files as svc
from gateway.services import storageuse

router = APIRouter(prefix="/portal", route_class=PortalRoute, include_in_schema=False,
                   dependencies=[portal_access(Policy.TENANT)])
DATASETS = "fine-tune"


def catalog_names(settings: Settings) -> list[str]:
    """The base model names of the catalog, sorted."""
    from trainer import catalog  # lazy: the trainer side (catalog), read per request

    return sorted({e.name for e in catalog.list_models(settings.models_root)})


@router.get("/datasets")
def list_datasets(request: Request, session: SessionDep, settings: SettingsDep, user: UserDep,
                  deleted: str | None = None) -> Response:
    """The tenant's datasets, newest first, and the upload form."""
    rows, _ = svc.list_files(session=session, principal=user.principal, purpose=DATASETS)
    try:
        used: dict[str, Any] | None = storageuse.usage(session=session, settings=settings, principal=user.principal)
    except ServiceError:
        used = None      # the broker does not answer: the page still lists the datasets
    return render(request, "datasets.html", user=user, files=rows, models=catalog_names(settings),
                  default_model=settings.default_model, limit=settings.max_upload_bytes,
                  deleted=deleted, usage=used)


@router.post("/datasets")
async def upload(request: Request, session: SessionDep, settings: SettingsDep, user: UserDep) -> Response:
    """Stream a multipart upload into the tenant's storage, exactly like POST /v1/files.

    The CSRF token comes in the ``X-CSRF-Token`` header (the page's script) or as a
    form field before the file (the plain form); it is checked before any byte is kept.
    """
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + 65536:
        raise TooLarge(f"the file is {length} bytes; the limit is {settings.max_upload_bytes} bytes")
    header = request.headers.get(CSRF_HEADER)
    if header is not None:
        check_csrf(user.csrf, header)
    chosen: dict[str, str | None] = {}

    def make_validator(fields: dict[str, str]) -> Validator:
        if header is None:
            check_csrf(user.csrf, fields.get(CSRF_FIELD))
        chosen["model"] = fields.get("model") or settings.default_model
        if chosen["model"] and chosen["model"] not in catalog_names(settings):
            chosen["model"] = settings.default_model
        return svc.upload_validator(settings, chosen["model"])

    up = await receive(request.stream(), request.headers.get("content-type", ""),
                       store=svc.tenant_storage(settings, user.principal),
                       limit=settings.max_upload_bytes, make_validator=make_validator)
    row = svc.store_upload(session=session, settings=settings, principal=user.principal, upload=up,
                           model=chosen.get("model"))
    url = f"/portal/datasets/{row.id}"
    if wants_json(request):
        return JSONResponse({"id": row.id, "status": row.status, "url": url})
    return RedirectResponse(url, status_code=303)


def report_view(row: DataFile) -> dict[str, Any]:
    """The validation report as the template shows it (missing parts as empty, never absent)."""
    rep = row.validation or {}
    stats = rep.get("stats") or {}
    return {"ok": bool(rep.get("ok")), "errors": rep.get("errors") or [],
            "error_counts": rep.get("error_counts") or {}, "warnings": rep.get("warnings") or [],
            "warning_counts": rep.get("warning_counts") or {}, "stats": stats,
            "tokens": stats.get("tokens") or {}, "max_seq_len": rep.get("max_seq_len")}


@router.get("/datasets/{file_id}")
def show_dataset(file_id: str, request: Request, session: SessionDep, user: UserDep) -> Response:
    """One dataset with its validation report."""
    row = svc.get_file(session=session, principal=user.principal, file_id=file_id)
    return render(request, "dataset.html", user=user, f=row, report=report_view(row))


@router.post("/datasets/{file_id}/delete")
def delete_dataset(file_id: str, session: SessionDep, settings: SettingsDep, user: UserDep,
                   csrf: Annotated[str, Form(max_length=100)] = "") -> Response:
    """Delete a dataset (CSRF-checked; refused while a job uses it) and go back to the list."""
    check_csrf(user.csrf, csrf)
    row = svc.get_file(session=session, principal=user.principal, file_id=file_id)
    svc.delete_file(session=session, settings=settings, principal=user.principal, file_id=file_id)
    return RedirectResponse(f"/portal/datasets?deleted={row.filename}", status_code=303)


@router.get("/files/{file_id}/download")
def download(file_id: str, session: SessionDep, settings: SettingsDep, user: UserDep) -> Response:
    """A dataset or a job's result file, as an attachment."""
    row = svc.get_file(session=session, principal=user.principal, file_id=file_id)
    assert user.principal.tenant_name is not None
    chunks = svc.stream_file(settings, user.principal.tenant_name, row)
    name = "".join(c for c in row.filename if c.isalnum() or c in "._-") or "download"
    media = "application/jsonl" if name.endswith(".jsonl") else "application/octet-stream"
    return StreamingResponse(chunks, media_type=media, headers={
        "content-length": str(row.bytes), "content-disposition": f'attachment; filename="{name}"'})
