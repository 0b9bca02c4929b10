"""Agents have an owner: the member who created them (NULL for older agents,
which only the workspace's admins and owner control).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.add_column(sa.Column("owner_id", sa.Uuid, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.drop_column("owner_id")
