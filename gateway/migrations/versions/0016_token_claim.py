"""One-time claim codes for operator-minted tenant_admin tokens.

Only the code's sha256 is stored; the code itself is written into the tenant's own
storage (as the tenant's unix user, 0600) and never shown to the operator. A token
becomes the tenant's own only by presenting that code (``finetune tokens claim``):
rotation alone no longer claims. Tokens minted before this revision have no code: a
tenant whose admin token is still operator-minted asks its sysadmin for a new one.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("claim_code_hash", sa.String(64), nullable=True))
    op.add_column("api_tokens", sa.Column("claim_expires_at", UTCDateTime(), nullable=True))
    op.add_column("api_tokens", sa.Column("claimed_at", UTCDateTime(), nullable=True))
    op.create_index("ix_api_tokens_claim_code_hash", "api_tokens", ["claim_code_hash"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_api_tokens_claim_code_hash", table_name="api_tokens")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("claimed_at")
        batch.drop_column("claim_expires_at")
        batch.drop_column("claim_code_hash")
