"""Model aliases: a tenant's named pointer per base model, moved by gated promotions.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("base_model", sa.String(length=100), nullable=False),
        sa.Column("alias", sa.String(length=40), nullable=False),
        sa.Column("fine_tuned_model", sa.String(length=255), nullable=False),
        sa.Column("promoted_at", UTCDateTime(), nullable=False),
        sa.Column("promoted_by", sa.Integer(), nullable=True),
        sa.UniqueConstraint("tenant_id", "base_model", "alias", name="uq_model_alias"),
    )
    op.create_index("ix_model_aliases_tenant_id", "model_aliases", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_model_aliases_tenant_id", table_name="model_aliases")
    op.drop_table("model_aliases")
