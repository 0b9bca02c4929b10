"""The IM's first schema: workspaces, members, groups, messages, read state, events.

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
    return "im" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "workspaces",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_table(
        "event_counters",
        sa.Column("workspace_id", sa.Uuid, primary_key=True),
        sa.Column("last_sequence", sa.BigInteger, nullable=False),
        schema=schema,
    )
    op.create_table(
        "members",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("display_name", sa.Text, nullable=False),
        sa.Column("avatar", sa.Text, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_index("ix_members_workspace", "members", ["workspace_id", "id"], schema=schema)
    op.create_table(
        "groups",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("creator_id", sa.Uuid, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("direct_key", sa.String(80), nullable=True),
        sa.UniqueConstraint("workspace_id", "direct_key", name="uq_groups_direct_key"),
        schema=schema,
    )
    op.create_table(
        "memberships",
        sa.Column("group_id", sa.Uuid, primary_key=True),
        sa.Column("member_id", sa.Uuid, primary_key=True),
        sa.Column("last_read_message_id", sa.Uuid, nullable=False),
        sa.Column("joined_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_index("ix_memberships_member", "memberships", ["member_id", "group_id"], schema=schema)
    op.create_table(
        "messages",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("group_id", sa.Uuid, nullable=False),
        sa.Column("sender_id", sa.Uuid, nullable=False),
        sa.Column("content_type", sa.String(16), nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("mentions", sa.JSON, nullable=False),
        sa.Column("reply_to", sa.Uuid, nullable=True),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("sent_at", UtcDateTime, nullable=False),
        sa.Column("edited_at", UtcDateTime, nullable=True),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=True),
        sa.UniqueConstraint("sender_id", "request_id", name="uq_messages_sender_request"),
        schema=schema,
    )
    op.create_index("ix_messages_group_id", "messages", ["group_id", "id"], schema=schema)
    op.create_table(
        "events",
        sa.Column("workspace_id", sa.Uuid, primary_key=True),
        sa.Column("sequence", sa.BigInteger, primary_key=True),
        sa.Column("group_id", sa.Uuid, nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("recorded_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_table(
        "requests",
        sa.Column("scope", sa.Uuid, primary_key=True),
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("resource_id", sa.Uuid, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    for table in ("requests", "events", "messages", "memberships", "groups", "members", "event_counters", "workspaces"):
        op.drop_table(table, schema=schema)
