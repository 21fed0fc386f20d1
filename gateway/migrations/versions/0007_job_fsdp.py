"""A job's sharding: FSDP over its ranks (resources.fsdp) or every rank holding the whole model.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("fsdp", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("fsdp")
