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

from gateway.state import JobState


class UTCDateTime(TypeDecorator[datetime]):
    """A DateTime that refuses naive input and returns aware UTC values."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        """``value`` in UTC (naive on SQLite, which keeps no zone); ValueError for a naive datetime."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: use datetime.now(UTC)")
        return value.astimezone(UTC).replace(tzinfo=None) if dialect.name == "sqlite" \
            else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        """``value`` as an aware UTC datetime (SQLite's naive values are UTC)."""
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A new random id: ``<prefix>-`` and 24 hex digits."""
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
    # who the tenant's people are (gateway.access.signin): the members of these unix groups as
    # NSS reports them (local files, sssd/LDAP), and the explicit TenantMember rows
    unix_group: str | None = Field(default=None, max_length=32)
    admin_group: str | None = Field(default=None, max_length=32)
    # storage limits the sysadmin set (the filesystem enforces them: gateway.storage.quota), and the
    # retention policy the sweeper applies: {"datasets"|"results"|"checkpoints"|"logs": days to keep}
    quota_bytes: int | None = Field(default=None, sa_type=sa.BigInteger)
    quota_files: int | None = Field(default=None, sa_type=sa.BigInteger)
    retention: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)


class TenantMember(SQLModel, table=True):
    """An explicit member (sites without groups): the unix user ``username`` belongs to the tenant."""

    __tablename__ = "tenant_members"
    __table_args__ = (sa.UniqueConstraint("tenant_id", "username", name="uq_tenant_member"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    username: str = Field(max_length=32)
    admin: bool = False
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Person(SQLModel, table=True):
    """Someone who signed in with the site's identity (a unix account: MUNGE on a cluster host, or the
    site's OpenID Connect provider mapped to one): behind their personal tokens, jobs, files and audit
    entries."""

    __tablename__ = "persons"

    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(index=True, unique=True, max_length=32)
    uid: int
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    last_sign_in_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_via: str | None = Field(default=None, max_length=16)     # munge | oidc


class SignInNonce(SQLModel, table=True):
    """A sign-in credential's nonce, kept until the credential expires: a second use is a replay,
    on any gateway sharing this database (each host's munged keeps only its own replay cache)."""

    __tablename__ = "sign_in_nonces"

    nonce: str = Field(primary_key=True, max_length=64)
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)


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
    # Provenance (gateway.access.tokens): who minted it, and whether an operator (the
    # root CLI, or a token descending from an operator's mint) may hold the secret.
    minted_by: str = Field(default="", max_length=100)
    minted_by_token_id: int | None = None
    minted_by_operator: bool = True
    revoked_by: str | None = Field(default=None, max_length=100)
    # An operator-minted tenant_admin token's one-time claim code (gateway.access.tokens):
    # its sha256 only, the code itself lives in the tenant's storage.
    claim_code_hash: str | None = Field(default=None, max_length=64, index=True, unique=True)
    claim_expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    claimed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # a personal token (sign-in) names its person and expires; a service token has neither
    person_id: int | None = Field(default=None, foreign_key="persons.id", index=True)
    via: str | None = Field(default=None, max_length=16)          # munge | oidc
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


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
    # result files live elsewhere than datasets/: their path relative to the tenant dir
    path: str | None = Field(default=None, max_length=300)
    job_id: str | None = Field(default=None, max_length=40, index=True)
    created_by: str | None = Field(default=None, max_length=64)   # gateway.access.tokens.who
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)   # expires_after


class FineTuningJob(SQLModel, table=True):
    """A fine-tuning job. ``status`` changes only through gateway.services.jobwrites, which
    applies gateway.state.transition under an optimistic ``version`` check."""

    __tablename__ = "fine_tuning_jobs"
    __table_args__ = (sa.UniqueConstraint("tenant_id", "idempotency_key", name="uq_job_idempotency"),
                      # a tenant's list, newest first, straight from the index (migration 0014)
                      sa.Index("ix_fine_tuning_jobs_tenant_created", "tenant_id", "created_at", "id"))

    id: str = Field(default_factory=lambda: new_id("ftjob"), primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    status: str = Field(default=JobState.VALIDATING_FILES.value, max_length=24, index=True)
    training_file: str = Field(foreign_key="files.id", max_length=40)
    validation_file: str | None = Field(default=None, foreign_key="files.id", max_length=40)
    model: str = Field(max_length=100)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    version: int = Field(default=0)
    phase: str | None = Field(default=None, max_length=16)
    model_digest: str | None = Field(default=None, max_length=80)
    hyperparameters: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)
    suffix: str | None = Field(default=None, max_length=64)
    seed: int | None = None
    meta: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)
    idempotency_key: str | None = Field(default=None, max_length=255)
    request_hash: str | None = Field(default=None, max_length=64)
    qos: str | None = Field(default=None, max_length=32)
    time_limit_min: int | None = None
    estimated_tokens: int | None = None
    # the gang: GPUs in all (one trainer rank each) over this many nodes (gpus % nodes == 0)
    gpus: int = Field(default=1)
    nodes: int = Field(default=1)
    fsdp: bool = Field(default=False)   # shard the model over the ranks (FSDP2), else every rank holds it
    # "supervised" (chat data) or "dpo" (preference pairs; its beta is in hyperparameters)
    method: str = Field(default="supervised", max_length=16, sa_column_kwargs={"server_default": "supervised"})
    # continued training: the parent fine-tuned model and its adapter tar (a result file of the parent)
    parent_model: str | None = Field(default=None, max_length=255)
    init_file: str | None = Field(default=None, max_length=40)
    lineage: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)   # the registry record, at publication
    sweep_id: str | None = Field(default=None, max_length=40, index=True)   # one run of this sweep
    slurm_job_id: int | None = Field(default=None, index=True)
    attempt: int = Field(default=0)
    slurm_state: str | None = Field(default=None, max_length=32)
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    cancel_requested_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    stop_confirmed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    cleanup: str | None = Field(default=None, max_length=16)       # pending | confirmed | failed | off (local mode)
    error: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)
    fine_tuned_model: str | None = Field(default=None, max_length=255, index=True)
    result_files: list[str] | None = Field(default=None, sa_type=sa.JSON)
    trained_tokens: int | None = None
    estimated_finish: datetime | None = Field(default=None, sa_type=UTCDateTime)
    expected_start: datetime | None = Field(default=None, sa_type=UTCDateTime)   # Slurm's plan while pending
    progress: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)
    events_offset: int = Field(default=0)
    # who submitted it, as the gateway recorded it (never from Slurm): a person's username, or
    # "token:<name or #id>" for a service token (gateway.access.tokens.who)
    created_by: str | None = Field(default=None, max_length=64, index=True)
    # OpenAI's ``integrations`` as the job object shows them: credentials never here (gateway.services.tracking)
    integrations: list[dict[str, Any]] | None = Field(default=None, sa_type=sa.JSON)


class JobEvent(SQLModel, table=True):
    """One entry of a job's event list (what /events returns), oldest first by id."""

    __tablename__ = "job_events"

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="fine_tuning_jobs.id", index=True, max_length=40)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    level: str = Field(default="info", max_length=8)
    type: str = Field(default="message", max_length=16)       # message | metrics
    message: str = Field(max_length=1000)
    data: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)


class JobCheckpoint(SQLModel, table=True):
    __tablename__ = "job_checkpoints"

    id: str = Field(default_factory=lambda: new_id("ftckpt"), primary_key=True, max_length=40)
    job_id: str = Field(foreign_key="fine_tuning_jobs.id", index=True, max_length=40)
    attempt: int = 0
    step: int
    path: str = Field(max_length=300)
    metrics: dict[str, Any] | None = Field(default=None, sa_type=sa.JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class AccessRequest(SQLModel, table=True):
    """A staff request to read one tenant resource; a grant once the tenant's admin approves.

    ``status``: pending → approved | denied; approved → revoked. "Expired" is not stored:
    an approved grant is usable only while ``approved_at <= now < expires_at``.
    """

    __tablename__ = "access_requests"

    id: str = Field(default_factory=lambda: new_id("acr"), primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    requester_token_id: int = Field(foreign_key="api_tokens.id", index=True)
    requester_role: str = Field(max_length=16)
    resource_kind: str = Field(max_length=8)          # job | file
    resource_id: str = Field(max_length=40)
    reason: str = Field(max_length=1000)
    duration_s: int
    status: str = Field(default="pending", max_length=16)
    created_at: datetime = Field(sa_type=UTCDateTime)
    decided_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    decided_by_token_id: int | None = Field(default=None, foreign_key="api_tokens.id")
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    revoked_by_token_id: int | None = Field(default=None, foreign_key="api_tokens.id")


class TenantDeletionRequest(SQLModel, table=True):
    """A tenant admin's request that the tenant and all its data be deleted; the sysadmin carries it
    out (``finetune admin tenant delete``). It names the tenant as text: it outlives the tenant row,
    with the sha256 of the deletion receipt. ``status``: pending → done | withdrawn."""

    __tablename__ = "tenant_deletion_requests"

    id: str = Field(default_factory=lambda: new_id("tdr"), primary_key=True, max_length=40)
    tenant: str = Field(max_length=24, index=True)
    requested_by: str = Field(max_length=100)
    reason: str = Field(default="", max_length=500)
    requested_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    status: str = Field(default="pending", max_length=16)
    decided_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    decided_by: str | None = Field(default=None, max_length=100)
    receipt_sha256: str | None = Field(default=None, max_length=64)


class AuditEntry(SQLModel, table=True):
    """One append-only audit record, hash-chained to the one before (gateway.access.audit)."""

    __tablename__ = "audit_log"

    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    at: datetime = Field(sa_type=UTCDateTime)
    actor_token_id: int | None = None
    actor_role: str = Field(max_length=16)
    actor: str | None = Field(default=None, max_length=100)    # "alice via munge"; hashed when set
    tenant: str | None = Field(default=None, max_length=24, index=True)
    resource: str | None = Field(default=None, max_length=60)
    action: str = Field(max_length=40)
    grant_id: str | None = Field(default=None, max_length=40)
    outcome: str = Field(max_length=8)                 # allowed | denied
    reason: str = Field(default="", max_length=500)
    prev_hash: str = Field(max_length=64)
    hash: str = Field(max_length=64)


class AuditHead(SQLModel, table=True):
    """The single row (id 1) naming the newest audit entry; appends lock it to stay serial."""

    __tablename__ = "audit_head"

    id: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    seq: int = 0
    hash: str = Field(max_length=64)
    mac: str | None = Field(default=None, max_length=64)       # HMAC-SHA256(key file, seq + hash)
    key_id: str | None = Field(default=None, max_length=16)    # which key made it (gateway.access.audit.key_id)


class PortalSession(SQLModel, table=True):
    """One signed-in portal session. The cookie carries a random session id; this row stores only
    its sha256. A session is valid only while its row exists: sign-out deletes it, so a replayed
    cookie is refused by every gateway process. Expired rows are pruned at sign-in."""

    __tablename__ = "portal_sessions"

    id_hash: str = Field(primary_key=True, max_length=64)
    token_id: int = Field(foreign_key="api_tokens.id", index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)


class Sweep(SQLModel, table=True):
    """A hyperparameter grid over one dataset and base: one job per point (``FineTuningJob.sweep_id``),
    submitted as the tasks of ONE Slurm job array (``slurm_array_id``), compared by validation loss."""

    __tablename__ = "sweeps"

    id: str = Field(default_factory=lambda: new_id("ftsweep"), primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    model: str = Field(max_length=255)
    grid: dict[str, Any] = Field(sa_type=sa.JSON)             # hyperparameter -> the values tried
    job_ids: list[str] = Field(sa_type=sa.JSON)               # in task order: task i runs job_ids[i]
    slurm_array_id: int | None = Field(default=None, index=True)
    suffix: str | None = Field(default=None, max_length=64)


class WebhookEndpoint(SQLModel, table=True):
    """A tenant's receiver of job events (registered by its admin); ``secret`` signs each delivery."""

    __tablename__ = "webhook_endpoints"

    id: str = Field(default_factory=lambda: new_id("whk"), primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    url: str = Field(max_length=2000)
    secret: str = Field(max_length=80)                        # whsec_<base64>, Standard Webhooks
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    deleted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class WebhookDelivery(SQLModel, table=True):
    """One event for one endpoint (the outbox row, written with the job's transition): ``id`` is its
    ``webhook-id``; tried until delivered (a 2xx) or out of attempts, with exponential back-off."""

    __tablename__ = "webhook_deliveries"

    id: str = Field(default_factory=lambda: new_id("msg"), primary_key=True, max_length=40)
    endpoint_id: str = Field(foreign_key="webhook_endpoints.id", index=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    event_type: str = Field(max_length=64)
    job_id: str = Field(max_length=40)
    body: str = Field(sa_type=sa.Text)
    status: str = Field(default="pending", max_length=16, index=True)   # gateway.state.DeliveryState
    attempts: int = 0
    next_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    last_status: int | None = None
    last_error: str | None = Field(default=None, max_length=300)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    delivered_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class ModelAlias(SQLModel, table=True):
    """A tenant's named pointer to one of its fine-tuned models of a base (``prod`` for tiny-chat),
    moved only by a gated promotion (gateway.services.registry)."""

    __tablename__ = "model_aliases"
    __table_args__ = (sa.UniqueConstraint("tenant_id", "base_model", "alias", name="uq_model_alias"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    base_model: str = Field(max_length=100)
    alias: str = Field(max_length=40)
    fine_tuned_model: str = Field(max_length=255)
    promoted_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    promoted_by: int | None = None            # the token id


class LeaderLease(SQLModel, table=True):
    """Who runs a singleton loop (the reconciler) across every gateway sharing this database, until when
    (the database's clock, unix seconds), and the fencing epoch bumped by every takeover
    (gateway.jobs.leader)."""

    __tablename__ = "leader_leases"

    name: str = Field(primary_key=True, max_length=40)
    holder: str = Field(default="", max_length=200)
    epoch: int = 0
    expires_at: float = 0.0


class MlflowRun(SQLModel, table=True):
    """A job's run on its tenant's MLflow tracking server, logged by the gateway
    (gateway.services.mlflowlog): where it is, and how far the job's events are logged."""

    __tablename__ = "mlflow_runs"

    job_id: str = Field(foreign_key="fine_tuning_jobs.id", primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    tracking_uri: str = Field(max_length=2000)
    experiment: str = Field(max_length=500)
    run_name: str | None = Field(default=None, max_length=250)
    credentials: str | None = Field(default=None, sa_type=sa.Text)    # encrypted (services.secretbox), never shown
    experiment_id: str | None = Field(default=None, max_length=64)
    run_id: str | None = Field(default=None, max_length=64)
    params_logged: bool = False
    event_cursor: int = 0              # the id of the last job event logged (JobEvent.id)
    sweep_id: str | None = Field(default=None, max_length=40, index=True)   # a child of MlflowParentRun
    status: str = Field(default="logging", max_length=16, index=True)   # gateway.state.TrackingState
    attempts: int = 0                  # failures in a row
    next_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    last_error: str | None = Field(default=None, max_length=300)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class MlflowParentRun(SQLModel, table=True):
    """A sweep's parent run on its tenant's MLflow server: each of the sweep's jobs logs a child run
    (``MlflowRun.sweep_id``, tag ``mlflow.parentRunId``); it ends when they all have."""

    __tablename__ = "mlflow_parent_runs"

    sweep_id: str = Field(foreign_key="sweeps.id", primary_key=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    tracking_uri: str = Field(max_length=2000)
    experiment: str = Field(max_length=500)
    run_name: str | None = Field(default=None, max_length=250)
    credentials: str | None = Field(default=None, sa_type=sa.Text)    # encrypted (services.secretbox), never shown
    experiment_id: str | None = Field(default=None, max_length=64)
    run_id: str | None = Field(default=None, max_length=64)
    status: str = Field(default="logging", max_length=16, index=True)   # gateway.state.TrackingState
    attempts: int = 0
    next_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    last_error: str | None = Field(default=None, max_length=300)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
