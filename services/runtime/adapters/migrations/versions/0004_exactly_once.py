"""Exactly once after a crash: what each agent has taken from its chats, a
pending pause that survives a restart, and the tasks left running found fast.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "read_marks",
        sa.Column("agent_id", sa.Uuid, primary_key=True),
        sa.Column("group_id", sa.Uuid, primary_key=True),
        sa.Column("message_id", sa.Uuid, nullable=False),
        schema=_schema(),
    )
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.add_column(sa.Column("pause_pending", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_index(
        "ix_tasks_running",
        "tasks",
        ["agent_id"],
        schema=_schema(),
        sqlite_where=sa.text("status = 'running'"),
        postgresql_where=sa.text("status = 'running'"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_running", table_name="tasks", schema=_schema())
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.drop_column("pause_pending")
    op.drop_table("read_marks", schema=_schema())
