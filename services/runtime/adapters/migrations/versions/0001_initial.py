"""The runtime's first schema: agents, their create requests, runs and steps.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "agents",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("member_id", sa.Uuid, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("system_prompt", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("base_url", sa.Text, nullable=False),
        sa.Column("temperature", sa.Float, nullable=True),
        sa.Column("max_tokens", sa.Integer, nullable=True),
        sa.Column("tools", sa.JSON, nullable=False),
        sa.Column("parent_id", sa.Uuid, nullable=True),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("updated_at", UtcDateTime, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_error", sa.Text, nullable=False),
        sa.Column("tokens_used", sa.BigInteger, nullable=False),
        sa.Column("token_budget", sa.BigInteger, nullable=False),
        sa.Column("session_id", sa.Uuid, nullable=False),
        sa.Column("deleted", sa.Boolean, nullable=False),
        schema=schema,
    )
    op.create_index("ix_agents_workspace", "agents", ["workspace_id", "id"], schema=schema)
    op.create_index("ix_agents_parent", "agents", ["parent_id", "id"], schema=schema)
    op.create_table(
        "agent_requests",
        sa.Column("scope", sa.Uuid, primary_key=True),
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("agent_id", sa.Uuid, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("agent_id", sa.Uuid, nullable=False),
        sa.Column("session_id", sa.Uuid, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("trigger_message_ids", sa.JSON, nullable=False),
        sa.Column("started_at", UtcDateTime, nullable=False),
        sa.Column("iterations", sa.Integer, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("ended_at", UtcDateTime, nullable=True),
        schema=schema,
    )
    op.create_index("ix_runs_agent", "runs", ["agent_id", "id"], schema=schema)
    op.create_table(
        "steps",
        sa.Column("id", sa.Uuid, primary_key=True),
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
        sa.UniqueConstraint("session_id", "sequence", name="uq_steps_session_sequence"),
        schema=schema,
    )
    op.create_index("ix_steps_run", "steps", ["run_id", "sequence"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    for table in ("steps", "runs", "agent_requests", "agents"):
        op.drop_table(table, schema=schema)
