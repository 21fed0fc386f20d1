"""/v1/files: OpenAI-compatible dataset files, scoped to the caller's tenant."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from gateway.access.policy import Policy
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.api.fastjson import FastJSON
from gateway.config import Settings
from gateway.datasets.uploads import receive
from gateway.datasets.validation import Validator
from gateway.errors import ServiceError, TooLarge
from gateway.models import DataFile
from gateway.services import files as svc

router = APIRouter(prefix="/v1/files", tags=["files"], dependencies=[access(Policy.TENANT)])
FILE_ID = r"^[A-Za-z0-9_-]{1,64}$"


def file_object(row: DataFile) -> dict[str, Any]:
    """OpenAI's file object plus our ``validation`` report."""
    return {
        "id": row.id, "object": "file", "bytes": row.bytes,
        "created_at": int(row.created_at.timestamp()),
        "expires_at": int(row.expires_at.timestamp()) if row.expires_at else None,
        "filename": row.filename, "purpose": row.purpose, "status": row.status,
        "status_details": row.status_details, "model": row.model, "validation": row.validation,
        "created_by": row.created_by,
    }


def declare_bounds(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Write this gateway's ``expires_after[seconds]`` bounds (settings, so not known at import) into the
    upload's schema, so a client reading the OpenAPI document learns what the upload accepts."""
    upload = schema.get("paths", {}).get("/v1/files", {}).get("post", {})
    form = upload.get("requestBody", {}).get("content", {}).get("multipart/form-data", {}).get("schema", {})
    if seconds := form.get("properties", {}).get(svc.EXPIRES_SECONDS):
        seconds.update(minimum=settings.file_expiry_min_s, maximum=settings.file_expiry_max_s)
    return schema


@router.post("", openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["fine-tune"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer"}},      # its bounds: declare_bounds
    # seconds alone counts from created_at (the only anchor); an anchor alone says nothing: 400
    "dependentRequired": {"expires_after[anchor]": ["expires_after[seconds]"]}}}}}}, status_code=200)
async def create_file(request: Request, session: SessionDep, settings: SettingsDep,
                      principal: PrincipalDep, model: str | None = Query(None, max_length=100)) -> dict[str, Any]:
    """Upload a chat JSONL dataset (multipart: ``file``, ``purpose=fine-tune``, optional ``model`` and
    OpenAI's ``expires_after[anchor]=created_at`` + ``expires_after[seconds]``: the sweeper deletes it then)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + 65536:
        raise TooLarge(f"the upload is {length} bytes; the limit is {settings.max_upload_bytes}")
    chosen: dict[str, str | None] = {}

    def make_validator(fields: dict[str, str]) -> Validator:
        chosen["model"] = model or fields.get("model") or settings.default_model
        return svc.upload_validator(settings, chosen["model"])

    up = await receive(request.stream(), request.headers.get("content-type", ""),
                       store=svc.tenant_storage(settings, principal),
                       limit=settings.max_upload_bytes, make_validator=make_validator)
    if up.fields.get("purpose") != "fine-tune":
        up.discard()
        raise ServiceError("purpose must be 'fine-tune'", param="purpose")
    if len(up.fields.get("model", "")) > 100:
        up.discard()
        raise ServiceError("model must be at most 100 characters", param="model")
    try:
        expires = svc.expires_after(settings, up.fields)
    except ServiceError:
        up.discard()
        raise
    row = svc.store_upload(session=session, settings=settings, principal=principal, upload=up,
                           model=chosen.get("model"), expires_after_s=expires)
    return file_object(row)


@router.get("")
def list_files(session: SessionDep, principal: PrincipalDep, purpose: str | None = None,
               after: str | None = Query(None, pattern=FILE_ID),
               limit: int = Query(10000, ge=1, le=10000),
               order: Literal["asc", "desc"] = "desc") -> FastJSON:
    """List this tenant's files, newest first (``order=asc``: oldest first), optionally of one ``purpose``.
    Paginate with ``after`` (a file id; an unknown one gives an empty page)."""
    rows, more = svc.list_files(session=session, principal=principal, purpose=purpose,
                                after=after, limit=limit, order=order)
    return FastJSON({"object": "list", "data": [file_object(r) for r in rows], "has_more": more,
                     "first_id": rows[0].id if rows else None, "last_id": rows[-1].id if rows else None})


@router.get("/{file_id}")
def retrieve_file(file_id: str, session: SessionDep, principal: PrincipalDep) -> FastJSON:
    """One of this tenant's files, with its validation report; 404 for an unknown or deleted id."""
    return FastJSON(file_object(svc.get_file(session=session, principal=principal, file_id=file_id)))


@router.get("/{file_id}/content")
def file_content(file_id: str, session: SessionDep, settings: SettingsDep,
                 principal: PrincipalDep) -> StreamingResponse:
    """The file's bytes (JSONL) as they were uploaded."""
    row = svc.get_file(session=session, principal=principal, file_id=file_id)
    assert principal.tenant_name is not None
    return StreamingResponse(svc.stream_file(settings, principal.tenant_name, row), media_type="application/jsonl",
                             headers={"content-length": str(row.bytes)})


@router.delete("/{file_id}")
def delete_file(file_id: str, session: SessionDep, settings: SettingsDep,
                principal: PrincipalDep) -> dict[str, Any]:
    """Delete a file; 409 (``file_in_use``) while a job that uses it has not finished.

    Identical uploads share their stored bytes, which leave storage with the last of them."""
    svc.delete_file(session=session, settings=settings, principal=principal, file_id=file_id)
    return {"id": file_id, "object": "file", "deleted": True}
