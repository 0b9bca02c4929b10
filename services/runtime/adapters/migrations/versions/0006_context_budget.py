"""The context budget: each agent's context window, and steps of their own
kind (summaries of runs that left the context, memories recalled at the
start of a run).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.add_column(sa.Column("context_tokens", sa.Integer, nullable=True))
    for table in ("steps", "step_archive"):
        with op.batch_alter_table(table, schema=_schema()) as batch:
            batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="message"))
            batch.add_column(sa.Column("summary_through", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    for table in ("steps", "step_archive"):
        with op.batch_alter_table(table, schema=_schema()) as batch:
            batch.drop_column("summary_through")
            batch.drop_column("kind")
    with op.batch_alter_table("agents", schema=_schema()) as batch:
        batch.drop_column("context_tokens")
