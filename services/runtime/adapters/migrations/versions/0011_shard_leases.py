"""Shard leases and live replicas, for several runtime replicas on one database.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "shard_leases",
        sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("expires_at", sa.Float, nullable=False, server_default="0"),
        schema=_schema(),
    )
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("address", sa.Text, nullable=False, server_default=""),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("replicas", schema=_schema())
    op.drop_table("shard_leases", schema=_schema())
