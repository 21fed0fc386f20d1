"""The OpenAI error body, and the error statuses every route may answer (for OpenAPI)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def error_body(message: str, *, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


_WHY = {400: "invalid request", 401: "missing or invalid API token", 403: "not allowed for this role",
        404: "no such resource (a foreign id answers the same)", 405: "method not allowed",
        409: "conflicts with the resource's state", 413: "over a size limit",
        429: "a per-tenant limit is reached", 500: "internal error (with a reference)",
        507: "storage is full"}
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": why} for code, why in _WHY.items()}


def strip_422(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents 422 for every route with parameters; this API answers 400 instead."""
    for path in schema.get("paths", {}).values():
        for op in path.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    return schema
