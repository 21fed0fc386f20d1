"""Data size and retention: tenants' storage quotas and retention policy, files that expire, and
tenant deletion requests (which outlive the tenant they name).

``tenants.quota_bytes``/``quota_files`` record the limits the sysadmin set (the filesystem
enforces them; the gateway reads usage from it). ``tenants.retention`` is the policy the
sweeper applies: days to keep per kind (datasets, results, checkpoints, logs). ``files.expires_at``
is OpenAI's ``expires_after`` resolved at upload. ``tenant_deletion_requests`` keeps the tenant's
name as text: it is kept after the tenant row is gone, with the receipt's sha256.

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("quota_bytes", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("quota_files", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("retention", sa.JSON(), nullable=True))
    op.add_column("files", sa.Column("expires_at", UTCDateTime(), nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"])
    op.create_table(
        "tenant_deletion_requests",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(24), nullable=False),
        sa.Column("requested_by", sa.String(100), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("requested_at", UTCDateTime(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("decided_at", UTCDateTime(), nullable=True),
        sa.Column("decided_by", sa.String(100), nullable=True),
        sa.Column("receipt_sha256", sa.String(64), nullable=True),
    )
    op.create_index("ix_tenant_deletion_requests_tenant", "tenant_deletion_requests", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_tenant_deletion_requests_tenant", table_name="tenant_deletion_requests")
    op.drop_table("tenant_deletion_requests")
    op.drop_index("ix_files_expires_at", table_name="files")
    op.drop_column("files", "expires_at")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("retention")
        batch.drop_column("quota_files")
        batch.drop_column("quota_bytes")
