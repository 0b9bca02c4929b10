"""Where the runtime's IM watch of each workspace got to, for a quick restart.

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
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "watch_cursors",
        sa.Column("workspace_id", sa.Uuid, primary_key=True),
        sa.Column("cursor", sa.String(64), nullable=False),
        sa.Column("updated_at", UtcDateTime, nullable=False),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("watch_cursors", schema=_schema())
