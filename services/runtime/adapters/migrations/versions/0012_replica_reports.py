"""What each runtime replica last reported of itself (with its lease renewal).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    with op.batch_alter_table("replicas", schema=_schema()) as table:
        table.add_column(sa.Column("reported_at", sa.Float, nullable=False, server_default="0"))
        table.add_column(sa.Column("report", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("replicas", schema=_schema()) as table:
        table.drop_column("report")
        table.drop_column("reported_at")
