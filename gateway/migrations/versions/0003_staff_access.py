"""Staff access requests (tenant-approved, time-bounded grants) and the hash-chained audit log.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

GENESIS = "0" * 64


def upgrade() -> None:
    op.create_table(
        "access_requests",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("requester_token_id", sa.Integer(), sa.ForeignKey("api_tokens.id"), nullable=False),
        sa.Column("requester_role", sa.String(16), nullable=False),
        sa.Column("resource_kind", sa.String(8), nullable=False),
        sa.Column("resource_id", sa.String(40), nullable=False),
        sa.Column("reason", sa.String(1000), nullable=False),
        sa.Column("duration_s", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("decided_at", UTCDateTime(), nullable=True),
        sa.Column("decided_by_token_id", sa.Integer(), sa.ForeignKey("api_tokens.id"), nullable=True),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.Column("revoked_by_token_id", sa.Integer(), sa.ForeignKey("api_tokens.id"), nullable=True),
    )
    op.create_index("ix_access_requests_tenant_id", "access_requests", ["tenant_id"])
    op.create_index("ix_access_requests_requester_token_id", "access_requests", ["requester_token_id"])
    op.create_table(
        "audit_log",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("actor_token_id", sa.Integer(), nullable=True),
        sa.Column("actor_role", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(24), nullable=True),
        sa.Column("resource", sa.String(60), nullable=True),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("grant_id", sa.String(40), nullable=True),
        sa.Column("outcome", sa.String(8), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )
    op.create_index("ix_audit_log_tenant", "audit_log", ["tenant"])
    head = op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )
    op.bulk_insert(head, [{"id": 1, "seq": 0, "hash": GENESIS}])


def downgrade() -> None:
    op.drop_table("audit_head")
    op.drop_index("ix_audit_log_tenant", "audit_log")
    op.drop_table("audit_log")
    op.drop_index("ix_access_requests_requester_token_id", "access_requests")
    op.drop_index("ix_access_requests_tenant_id", "access_requests")
    op.drop_table("access_requests")
