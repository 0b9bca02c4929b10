"""Agent control (issue 5): interrupted steps, sessions, checkpoints, the step
archive and the task queue.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def _step_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("id", sa.Uuid, nullable=False),
        sa.Column("agent_id", sa.Uuid, nullable=False),
        sa.Column("session_id", sa.Uuid, nullable=False),
        sa.Column("run_id", sa.Uuid, nullable=False),
        sa.Column("sequence", sa.BigInteger, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text, nullable=True),
        sa.Column("reasoning", sa.Text, nullable=True),
        sa.Column("tool_calls", sa.JSON, nullable=False),
        sa.Column("tool_call_id", sa.Text, nullable=True),
        sa.Column("name", sa.Text, nullable=True),
        sa.Column("duration_ms", sa.Float, nullable=False),
        sa.Column("first_token_ms", sa.Float, nullable=False),
        sa.Column("input_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
        sa.Column("cached_tokens", sa.BigInteger, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("tool_duration_ms", sa.Float, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("interrupted", sa.Boolean, nullable=False),
    ]


def upgrade() -> None:
    schema = _schema()
    prefix = f"{schema}." if schema else ""
    with op.batch_alter_table("steps", schema=schema) as batch:
        batch.add_column(sa.Column("interrupted", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_table(
        "sessions",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("agent_id", sa.Uuid, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("forked_from", sa.Uuid, nullable=True),
        sa.Column("forked_at_sequence", sa.BigInteger, nullable=False),
        sa.Index("ix_sessions_agent", "agent_id", "id"),
        schema=schema,
    )
    # Every agent so far has one session, its main one.
    op.execute(
        f"INSERT INTO {prefix}sessions (id, agent_id, created_at, forked_from, forked_at_sequence) "
        f"SELECT session_id, id, created_at, NULL, 0 FROM {prefix}agents"
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("agent_id", sa.Uuid, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("session_id", sa.Uuid, nullable=False),
        sa.Column("sequence", sa.BigInteger, nullable=False),
        sa.Column("settings", sa.JSON, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Index("ix_checkpoints_agent", "agent_id", "id"),
        schema=schema,
    )
    op.create_table(
        "step_archive",
        sa.Column("archive_id", sa.Uuid, primary_key=True),
        sa.Column("archived_at", UtcDateTime, nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        *_step_columns(),
        sa.Index("ix_step_archive_session", "session_id", "sequence"),
        schema=schema,
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("agent_id", sa.Uuid, nullable=False),
        sa.Column("session_id", sa.Uuid, nullable=False),
        sa.Column("input", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=False),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("started_at", UtcDateTime, nullable=True),
        sa.Column("ended_at", UtcDateTime, nullable=True),
        sa.Column("retry_at", UtcDateTime, nullable=True),
        sa.Column("run_id", sa.Uuid, nullable=True),
        sa.Index("ix_tasks_agent", "agent_id", "id"),
        # The queue: per agent and status, by priority then arrival. The next
        # task is the first entry of an index range (see `SqlAgentStore.next_task`).
        sa.Index("ix_tasks_queue", "agent_id", "status", "priority", "created_at", "id"),
        sa.Index(
            "uq_tasks_agent_request",
            "agent_id",
            "request_id",
            unique=True,
            sqlite_where=sa.text("request_id != ''"),
            postgresql_where=sa.text("request_id != ''"),
        ),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    for table in ("tasks", "step_archive", "checkpoints", "sessions"):
        op.drop_table(table, schema=schema)
    with op.batch_alter_table("steps", schema=schema) as batch:
        batch.drop_column("interrupted")
