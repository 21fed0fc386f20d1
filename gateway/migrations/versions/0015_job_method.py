"""A job's training method: supervised (SFT on chat data) or dpo (preference pairs).

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("method", sa.String(length=16), nullable=False,
                                                server_default="supervised"))


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("method")
