"""MLflow integrations: a job's ``integrations`` as shown (no credentials), and one row per job with an
MLflow integration: the tenant's tracking server, the run there, the encrypted credentials and the
cursor of the job events already logged (gateway.services.mlflowlog).

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("integrations", sa.JSON(), nullable=True))
    op.create_table(
        "mlflow_runs",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("fine_tuning_jobs.id"), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("tracking_uri", sa.String(2000), nullable=False),
        sa.Column("experiment", sa.String(500), nullable=False),
        sa.Column("run_name", sa.String(250), nullable=True),
        sa.Column("credentials", sa.Text(), nullable=True),
        sa.Column("experiment_id", sa.String(64), nullable=True),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("params_logged", sa.Boolean(), nullable=False),
        sa.Column("event_cursor", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", UTCDateTime(), nullable=False),
        sa.Column("last_error", sa.String(300), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_mlflow_runs_tenant_id", "mlflow_runs", ["tenant_id"])
    op.create_index("ix_mlflow_runs_status", "mlflow_runs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_mlflow_runs_status", table_name="mlflow_runs")
    op.drop_index("ix_mlflow_runs_tenant_id", table_name="mlflow_runs")
    op.drop_table("mlflow_runs")
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("integrations")
