"""Database tables (SQLModel). Writes go through gateway/services/, never routes.

Timestamps are stored as UTC and always come back timezone-aware, on SQLite too.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel


class UTCDateTime(TypeDecorator[datetime]):
    """A DateTime that refuses naive input and returns aware UTC values."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: use datetime.now(UTC)")
        return value.astimezone(UTC).replace(tzinfo=None) if dialect.name == "sqlite" \
            else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class Role(StrEnum):
    MEMBER = "member"
    TENANT_ADMIN = "tenant_admin"
    SYSADMIN = "sysadmin"
    STAFF = "staff"


TENANT_ROLES = frozenset({Role.MEMBER, Role.TENANT_ADMIN})


class FileStatus(StrEnum):
    UPLOADED = "uploaded"
    PROCESSED = "processed"
    ERROR = "error"


class Tenant(SQLModel, table=True):
    __tablename__ = "tenants"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=24)
    unix_user: str = Field(max_length=32)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_tokens"

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int | None = Field(default=None, foreign_key="tenants.id", index=True)
    role: str = Field(max_length=16)
    name: str = Field(default="", max_length=100)
    prefix: str = Field(max_length=16)              # shown in listings, not secret
    token_hash: str = Field(index=True, unique=True, max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class DataFile(SQLModel, table=True):
    """An uploaded dataset. The bytes live in the tenant's storage, named by sha256."""

    __tablename__ = "files"

    id: str = Field(default_factory=lambda: new_id("file"), primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    filename: str = Field(max_length=255)
    purpose: str = Field(default="fine-tune", max_length=32)
    bytes: int
    sha256: str = Field(index=True, max_length=64)
    status: str = Field(default=FileStatus.UPLOADED, max_length=16)
    status_details: str | None = Field(default=None, max_length=2000)
    model: str | None = Field(default=None, max_length=100)   # tokenizer used for the checks
    validation: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    deleted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class FineTuningJob(SQLModel, table=True):
    """A fine-tuning job (the lifecycle columns arrive with the jobs feature)."""

    __tablename__ = "fine_tuning_jobs"

    id: str = Field(default_factory=lambda: new_id("ftjob"), primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    status: str = Field(default="validating_files", max_length=24, index=True)
    training_file: str = Field(foreign_key="files.id", max_length=40)
    validation_file: str | None = Field(default=None, foreign_key="files.id", max_length=40)
    model: str = Field(max_length=100)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
