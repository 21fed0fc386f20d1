"""A job's resources: GPUs in all (one trainer rank each) and nodes; every earlier job had 1 and 1.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("gpus", sa.Integer(), nullable=False, server_default="1"))
    op.add_column("fine_tuning_jobs", sa.Column("nodes", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("nodes")
        batch.drop_column("gpus")
