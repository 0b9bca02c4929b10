"""Input steps keep where they came from (the message's sender and chat, or
the task) apart from their text; agents count their state changes.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    for table in ("steps", "step_archive"):
        with op.batch_alter_table(table, schema=_schema()) as batch:
            batch.add_column(sa.Column("origin", sa.JSON, nullable=True))
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.add_column(sa.Column("state_version", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.drop_column("state_version")
    for table in ("steps", "step_archive"):
        with op.batch_alter_table(table, schema=_schema()) as batch:
            batch.drop_column("origin")
