"""A pending job's expected start, from Slurm's plan (``squeue --start``), kept by the reconciler.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("expected_start", UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("expected_start")
