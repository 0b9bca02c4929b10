"""The runtime's audit log: agents and what people did to them (named apart
from the IM's `audit_events`: on SQLite both services may share one file).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "agent_audit_events",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=True),
        sa.Column("actor_kind", sa.String(16), nullable=False),
        sa.Column("actor_member_id", sa.Uuid, nullable=True),
        sa.Column("actor_service", sa.String(64), nullable=True),
        sa.Column("actor_key", sa.String(80), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target_kind", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(200), nullable=False),
        sa.Column("at", UtcDateTime, nullable=False),
        sa.Column("last_at", UtcDateTime, nullable=False),
        sa.Column("code", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("details", sa.JSON, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        schema=schema,
    )
    op.create_index(
        "ix_agent_audit_events_workspace_at",
        "agent_audit_events",
        ["workspace_id", "at", "id"],
        schema=schema,
    )
    op.create_index("ix_agent_audit_events_at", "agent_audit_events", ["at"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    op.drop_table("agent_audit_events", schema=schema)
