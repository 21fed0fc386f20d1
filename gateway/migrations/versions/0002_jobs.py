"""Fine-tuning job lifecycle: job columns, events, checkpoints, result files.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JOB_COLUMNS = [
    sa.Column("version", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("phase", sa.String(16), nullable=True),
    sa.Column("model_digest", sa.String(80), nullable=True),
    sa.Column("hyperparameters", sa.JSON(), nullable=True),
    sa.Column("suffix", sa.String(64), nullable=True),
    sa.Column("seed", sa.Integer(), nullable=True),
    sa.Column("meta", sa.JSON(), nullable=True),
    sa.Column("idempotency_key", sa.String(255), nullable=True),
    sa.Column("request_hash", sa.String(64), nullable=True),
    sa.Column("qos", sa.String(32), nullable=True),
    sa.Column("time_limit_min", sa.Integer(), nullable=True),
    sa.Column("estimated_tokens", sa.Integer(), nullable=True),
    sa.Column("slurm_job_id", sa.Integer(), nullable=True),
    sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("slurm_state", sa.String(32), nullable=True),
    sa.Column("started_at", UTCDateTime(), nullable=True),
    sa.Column("finished_at", UTCDateTime(), nullable=True),
    sa.Column("cancel_requested_at", UTCDateTime(), nullable=True),
    sa.Column("stop_confirmed_at", UTCDateTime(), nullable=True),
    sa.Column("cleanup", sa.String(16), nullable=True),
    sa.Column("error", sa.JSON(), nullable=True),
    sa.Column("fine_tuned_model", sa.String(255), nullable=True),
    sa.Column("result_files", sa.JSON(), nullable=True),
    sa.Column("trained_tokens", sa.Integer(), nullable=True),
    sa.Column("estimated_finish", UTCDateTime(), nullable=True),
    sa.Column("progress", sa.JSON(), nullable=True),
    sa.Column("events_offset", sa.Integer(), nullable=False, server_default="0"),
]


def upgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as b:
        for col in JOB_COLUMNS:
            b.add_column(col)
        b.create_unique_constraint("uq_job_idempotency", ["tenant_id", "idempotency_key"])
        b.create_index("ix_fine_tuning_jobs_slurm_job_id", ["slurm_job_id"])
        b.create_index("ix_fine_tuning_jobs_fine_tuned_model", ["fine_tuned_model"])
    with op.batch_alter_table("files") as b:
        b.add_column(sa.Column("path", sa.String(300), nullable=True))
        b.add_column(sa.Column("job_id", sa.String(40), nullable=True))
        b.create_index("ix_files_job_id", ["job_id"])
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("fine_tuning_jobs.id"), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("level", sa.String(8), nullable=False),
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("message", sa.String(1000), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])
    op.create_table(
        "job_checkpoints",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("fine_tuning_jobs.id"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(300), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_job_checkpoints_job_id", "job_checkpoints", ["job_id"])


def downgrade() -> None:
    op.drop_table("job_checkpoints")
    op.drop_table("job_events")
    with op.batch_alter_table("files") as b:
        b.drop_index("ix_files_job_id")
        b.drop_column("job_id")
        b.drop_column("path")
    with op.batch_alter_table("fine_tuning_jobs") as b:
        b.drop_index("ix_fine_tuning_jobs_fine_tuned_model")
        b.drop_index("ix_fine_tuning_jobs_slurm_job_id")
        b.drop_constraint("uq_job_idempotency")
        for col in reversed(JOB_COLUMNS):
            b.drop_column(col.name)
