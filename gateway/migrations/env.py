"""Alembic environment: runs on the connection gateway.db.migrate hands it."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import gateway.models  # noqa: F401  (registers the tables on the metadata)

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through gateway.db.migrate(engine)")
context.configure(connection=connection, target_metadata=SQLModel.metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
