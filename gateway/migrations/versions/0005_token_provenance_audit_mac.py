"""Token provenance (who minted each token, whether an operator may hold it) and the
audit head's HMAC anchor.

Tokens minted before this revision were all minted by the root CLI (the only path),
so they are marked operator-minted: a tenant admin claims a token of its own with
`finetune tokens rotate` before deciding staff access requests again.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

BEFORE = "the admin CLI, before provenance was recorded"


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("minted_by", sa.String(100), nullable=False, server_default=BEFORE))
    op.add_column("api_tokens", sa.Column("minted_by_token_id", sa.Integer(), nullable=True))
    op.add_column("api_tokens", sa.Column("minted_by_operator", sa.Boolean(), nullable=False,
                                          server_default=sa.true()))
    op.add_column("api_tokens", sa.Column("revoked_by", sa.String(100), nullable=True))
    op.add_column("audit_head", sa.Column("mac", sa.String(64), nullable=True))
    op.add_column("audit_head", sa.Column("key_id", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_head") as batch:
        batch.drop_column("key_id")
        batch.drop_column("mac")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("revoked_by")
        batch.drop_column("minted_by_operator")
        batch.drop_column("minted_by_token_id")
        batch.drop_column("minted_by")
