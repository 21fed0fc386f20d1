"""Sweeps: a hyperparameter grid run as one Slurm job array; each job names its sweep.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=40), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("grid", sa.JSON(), nullable=False),
        sa.Column("job_ids", sa.JSON(), nullable=False),
        sa.Column("slurm_array_id", sa.Integer(), nullable=True),
        sa.Column("suffix", sa.String(length=64), nullable=True),
    )
    op.create_index("ix_sweeps_tenant_id", "sweeps", ["tenant_id"])
    op.create_index("ix_sweeps_slurm_array_id", "sweeps", ["slurm_array_id"])
    op.add_column("fine_tuning_jobs", sa.Column("sweep_id", sa.String(length=40), nullable=True))
    op.create_index("ix_fine_tuning_jobs_sweep_id", "fine_tuning_jobs", ["sweep_id"])


def downgrade() -> None:
    op.drop_index("ix_fine_tuning_jobs_sweep_id", table_name="fine_tuning_jobs")
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("sweep_id")
    op.drop_index("ix_sweeps_slurm_array_id", table_name="sweeps")
    op.drop_index("ix_sweeps_tenant_id", table_name="sweeps")
    op.drop_table("sweeps")
