"""MLflow for sweeps: a sweep's parent run (``mlflow_parent_runs``), and which sweep a job's run is a child of
(``mlflow_runs.sweep_id``).

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

from gateway.models import UTCDateTime

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("mlflow_runs", sa.Column("sweep_id", sa.String(40), nullable=True))
    op.create_index("ix_mlflow_runs_sweep_id", "mlflow_runs", ["sweep_id"])
    op.create_table(
        "mlflow_parent_runs",
        sa.Column("sweep_id", sa.String(40), sa.ForeignKey("sweeps.id"), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("tracking_uri", sa.String(2000), nullable=False),
        sa.Column("experiment", sa.String(500), nullable=False),
        sa.Column("run_name", sa.String(250), nullable=True),
        sa.Column("credentials", sa.Text(), nullable=True),
        sa.Column("experiment_id", sa.String(64), nullable=True),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", UTCDateTime(), nullable=False),
        sa.Column("last_error", sa.String(300), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_mlflow_parent_runs_tenant_id", "mlflow_parent_runs", ["tenant_id"])
    op.create_index("ix_mlflow_parent_runs_status", "mlflow_parent_runs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_mlflow_parent_runs_status", table_name="mlflow_parent_runs")
    op.drop_index("ix_mlflow_parent_runs_tenant_id", table_name="mlflow_parent_runs")
    op.drop_table("mlflow_parent_runs")
    op.drop_index("ix_mlflow_runs_sweep_id", table_name="mlflow_runs")
    with op.batch_alter_table("mlflow_runs") as batch:
        batch.drop_column("sweep_id")
