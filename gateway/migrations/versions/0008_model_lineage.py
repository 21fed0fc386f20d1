"""Model lineage: a job continued from a parent model (its adapter file) and the registry record.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("parent_model", sa.String(length=255), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("init_file", sa.String(length=40), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("lineage", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("lineage")
        batch.drop_column("init_file")
        batch.drop_column("parent_model")
