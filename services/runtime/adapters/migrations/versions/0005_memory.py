"""Long-term memory: the chat each run answers, which ended runs the memory
service has (the outbox is the ended runs not yet archived), and how many
memories each agent recalls at the start of a run.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.add_column(sa.Column("auto_recall", sa.Integer, nullable=True))
    with op.batch_alter_table("runs", schema=_schema()) as batch:
        batch.add_column(sa.Column("group_id", sa.Uuid, nullable=True))
        batch.add_column(sa.Column("archived_at", UtcDateTime, nullable=True))
    op.create_index(
        "ix_runs_unarchived",
        "runs",
        ["ended_at"],
        schema=_schema(),
        sqlite_where=sa.text("archived_at IS NULL AND ended_at IS NOT NULL"),
        postgresql_where=sa.text("archived_at IS NULL AND ended_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_runs_unarchived", table_name="runs", schema=_schema())
    with op.batch_alter_table("runs", schema=_schema()) as batch:
        batch.drop_column("archived_at")
        batch.drop_column("group_id")
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.drop_column("auto_recall")
