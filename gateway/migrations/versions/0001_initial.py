"""Tenants, API tokens, files, fine-tuning jobs (first cut).

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(24), nullable=False),
        sa.Column("unix_user", sa.String(32), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_tenants_name", "tenants", ["name"], unique=True)
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_api_tokens_tenant_id", "api_tokens", ["tenant_id"])
    op.create_index("ix_api_tokens_token_hash", "api_tokens", ["token_hash"], unique=True)
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_details", sa.String(2000), nullable=True),
        sa.Column("model", sa.String(100), nullable=True),
        sa.Column("validation", sa.JSON(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_files_tenant_id", "files", ["tenant_id"])
    op.create_index("ix_files_sha256", "files", ["sha256"])
    op.create_table(
        "fine_tuning_jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("training_file", sa.String(40), sa.ForeignKey("files.id"), nullable=False),
        sa.Column("validation_file", sa.String(40), sa.ForeignKey("files.id"), nullable=True),
        sa.Column("model", sa.String(100), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_fine_tuning_jobs_tenant_id", "fine_tuning_jobs", ["tenant_id"])
    op.create_index("ix_fine_tuning_jobs_status", "fine_tuning_jobs", ["status"])


def downgrade() -> None:
    for table in ("fine_tuning_jobs", "files", "api_tokens", "tenants"):
        op.drop_table(table)
