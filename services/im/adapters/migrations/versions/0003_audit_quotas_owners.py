"""The audit log, agents' owners, and the index that counts groups for quotas.

Agents made before this have no known owner until their host tells the IM
(the runtime does at start-up, `SetAgentOwners`).

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
    return "im" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.add_column("members", sa.Column("owner_id", sa.Uuid, nullable=True), schema=schema)
    op.create_index("ix_groups_workspace_kind", "groups", ["workspace_id", "kind"], schema=schema)
    op.create_table(
        "audit_events",
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
        "ix_audit_events_workspace_at", "audit_events", ["workspace_id", "at", "id"], schema=schema
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    op.drop_table("audit_events", schema=schema)
    op.drop_index("ix_groups_workspace_kind", table_name="groups", schema=schema)
    with op.batch_alter_table("members", schema=schema) as batch:
        batch.drop_column("owner_id")
