"""Persons: tenants bound to unix groups, explicit members, personal tokens that expire, and who
made each job, file and audit entry.

A person is a unix account that signed in (MUNGE on a cluster host, the site's OpenID Connect
provider mapped to one). Tokens minted before this revision are service tokens (no person, no
expiry); jobs and files made before it have no ``created_by``; audit entries before it have no
``actor``, and their hashes are unchanged (the field is hashed only when set).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("unix_group", sa.String(32), nullable=True))
    op.add_column("tenants", sa.Column("admin_group", sa.String(32), nullable=True))
    op.create_table(
        "tenant_members",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("username", sa.String(32), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("tenant_id", "username", name="uq_tenant_member"),
    )
    op.create_index("ix_tenant_members_tenant_id", "tenant_members", ["tenant_id"])
    op.create_table(
        "persons",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("username", sa.String(32), nullable=False),
        sa.Column("uid", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("last_sign_in_at", UTCDateTime(), nullable=True),
        sa.Column("last_via", sa.String(16), nullable=True),
    )
    op.create_index("ix_persons_username", "persons", ["username"], unique=True)
    op.create_table(
        "sign_in_nonces",
        sa.Column("nonce", sa.String(64), primary_key=True),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_sign_in_nonces_expires_at", "sign_in_nonces", ["expires_at"])
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("person_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("via", sa.String(16), nullable=True))
        batch.add_column(sa.Column("expires_at", UTCDateTime(), nullable=True))
        batch.create_foreign_key("fk_api_tokens_person_id", "persons", ["person_id"], ["id"])
    op.create_index("ix_api_tokens_person_id", "api_tokens", ["person_id"])
    op.add_column("files", sa.Column("created_by", sa.String(64), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("created_by", sa.String(64), nullable=True))
    op.create_index("ix_fine_tuning_jobs_created_by", "fine_tuning_jobs", ["created_by"])
    op.add_column("audit_log", sa.Column("actor", sa.String(100), nullable=True))


def downgrade() -> None:
    op.drop_column("audit_log", "actor")
    op.drop_index("ix_fine_tuning_jobs_created_by", table_name="fine_tuning_jobs")
    op.drop_column("fine_tuning_jobs", "created_by")
    op.drop_column("files", "created_by")
    op.drop_index("ix_api_tokens_person_id", table_name="api_tokens")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_constraint("fk_api_tokens_person_id", type_="foreignkey")
        batch.drop_column("expires_at")
        batch.drop_column("via")
        batch.drop_column("person_id")
    op.drop_table("sign_in_nonces")
    op.drop_table("persons")
    op.drop_table("tenant_members")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("admin_group")
        batch.drop_column("unix_group")
