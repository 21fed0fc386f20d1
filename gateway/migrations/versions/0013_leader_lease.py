"""The reconciler's lease: one reconciler at a time across gateways sharing the database.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "leader_leases",
        sa.Column("name", sa.String(length=40), primary_key=True),
        sa.Column("holder", sa.String(length=200), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )
    op.bulk_insert(table, [{"name": "reconciler", "holder": "", "epoch": 0, "expires_at": 0.0}])


def downgrade() -> None:
    op.drop_table("leader_leases")
