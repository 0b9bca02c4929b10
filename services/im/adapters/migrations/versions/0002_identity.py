"""Identity: member roles and agent hosts; accounts, refresh tokens, invites,
personal access tokens, sign-in attempts.

Existing members become plain members, except the earliest person of each
workspace, who becomes its owner; existing agents are hosted by the runtime
(the only service that has ever created agents).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "im" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.add_column(
        "members", sa.Column("role", sa.String(16), nullable=False, server_default="member"), schema=schema
    )
    op.add_column("members", sa.Column("host", sa.String(64), nullable=True), schema=schema)
    members = f"{schema}.members" if schema else "members"
    # The earliest person of each workspace (by creation time, then id) owns it.
    op.execute(
        f"""
        UPDATE {members} SET role = 'owner'
        WHERE kind = 'human' AND NOT EXISTS (
            SELECT 1 FROM {members} AS earlier
            WHERE earlier.workspace_id = {members}.workspace_id
              AND earlier.kind = 'human'
              AND (earlier.created_at < {members}.created_at
                   OR (earlier.created_at = {members}.created_at AND earlier.id < {members}.id))
        )
        """
    )
    op.execute(f"UPDATE {members} SET host = 'runtime' WHERE kind = 'agent'")
    op.create_table(
        "accounts",
        sa.Column("member_id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("login", sa.String(64), nullable=False),
        sa.Column("password_hash", sa.Text, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("password_changed_at", UtcDateTime, nullable=False),
        sa.UniqueConstraint("workspace_id", "login", name="uq_accounts_login"),
        schema=schema,
    )
    op.create_table(
        "refresh_tokens",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("family_id", sa.Uuid, nullable=False),
        sa.Column("member_id", sa.Uuid, nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("expires_at", UtcDateTime, nullable=False),
        sa.Column("used_at", UtcDateTime, nullable=True),
        sa.Column("revoked_at", UtcDateTime, nullable=True),
        sa.UniqueConstraint("token_hash", name="uq_refresh_tokens_hash"),
        schema=schema,
    )
    op.create_index("ix_refresh_tokens_family", "refresh_tokens", ["family_id"], schema=schema)
    op.create_index("ix_refresh_tokens_member", "refresh_tokens", ["member_id"], schema=schema)
    op.create_table(
        "invites",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_by", sa.Uuid, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("expires_at", UtcDateTime, nullable=False),
        sa.Column("used_at", UtcDateTime, nullable=True),
        sa.Column("used_by", sa.Uuid, nullable=True),
        sa.UniqueConstraint("secret_hash", name="uq_invites_secret_hash"),
        schema=schema,
    )
    op.create_table(
        "personal_tokens",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("member_id", sa.Uuid, nullable=False),
        sa.Column("workspace_id", sa.Uuid, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("expires_at", UtcDateTime, nullable=False),
        sa.Column("last_used_at", UtcDateTime, nullable=True),
        sa.Column("revoked_at", UtcDateTime, nullable=True),
        sa.UniqueConstraint("secret_hash", name="uq_personal_tokens_secret_hash"),
        schema=schema,
    )
    op.create_index("ix_personal_tokens_member", "personal_tokens", ["member_id", "id"], schema=schema)
    op.create_table(
        "sign_in_attempts",
        sa.Column("workspace_id", sa.Uuid, primary_key=True),
        sa.Column("login", sa.String(64), primary_key=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("window_start", UtcDateTime, nullable=False),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    for table in ("sign_in_attempts", "personal_tokens", "invites", "refresh_tokens", "accounts"):
        op.drop_table(table, schema=schema)
    with op.batch_alter_table("members", schema=schema) as batch:
        batch.drop_column("host")
        batch.drop_column("role")
