"""A tenant's job list, newest first, read straight from an index (no sort of all its jobs).

Revision ID: 0014
Revises: 0013
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_fine_tuning_jobs_tenant_created", "fine_tuning_jobs", ["tenant_id", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_fine_tuning_jobs_tenant_created", "fine_tuning_jobs")
