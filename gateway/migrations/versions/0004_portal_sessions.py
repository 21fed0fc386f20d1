"""Server-side portal sessions: sign-out deletes the row, so a replayed cookie is refused.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "portal_sessions",
        sa.Column("id_hash", sa.String(64), primary_key=True),
        sa.Column("token_id", sa.Integer(), sa.ForeignKey("api_tokens.id"), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_portal_sessions_token_id", "portal_sessions", ["token_id"])
    op.create_index("ix_portal_sessions_expires_at", "portal_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_portal_sessions_expires_at", "portal_sessions")
    op.drop_index("ix_portal_sessions_token_id", "portal_sessions")
    op.drop_table("portal_sessions")
