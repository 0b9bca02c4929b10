"""Whether a step's token counts are the runtime's own estimate (the
endpoint reported no usage).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    for table in ("steps", "step_archive"):
        with op.batch_alter_table(table, schema=_schema()) as batch:
            batch.add_column(
                sa.Column("usage_estimated", sa.Boolean, nullable=False, server_default=sa.false())
            )


def downgrade() -> None:
    for table in ("steps", "step_archive"):
        with op.batch_alter_table(table, schema=_schema()) as batch:
            batch.drop_column("usage_estimated")
