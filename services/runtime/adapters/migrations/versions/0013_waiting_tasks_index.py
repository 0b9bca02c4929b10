"""An index of the waiting tasks, which every replica's reconcile looks for
across all agents (it read every task ever finished, each time).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_WAITING = "status IN ('queued', 'failed')"


def _schema() -> str | None:
    return "runtime" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_index(
        "ix_tasks_waiting",
        "tasks",
        ["agent_id", "status"],
        schema=_schema(),
        sqlite_where=sa.text(_WAITING),
        postgresql_where=sa.text(_WAITING),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_waiting", table_name="tasks", schema=_schema())
