"""Vectors apart from segments: `segment_vectors`, and the embedder's queue `unembedded`.

Storing a vector used to rewrite its segment's row, and on PostgreSQL every
index entry of it with it, the GIN index's included: vectors were stored at
3,400 segments/s there against 17,000 on SQLite. The segments keep their
text; what waits for a vector is a row of `unembedded`.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# As 0001 made `segments.id` (a migration keeps its own copy of what it builds on).
_SEGMENT_KEY = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_PENDING_INDEXES = {
    "ix_memory_segments_unembedded": "id",
    "ix_memory_segments_unembedded_agent": "agent_id",
    "ix_memory_segments_unembedded_workspace": "workspace_id",
}


def _schema() -> str | None:
    return "memory" if op.get_bind().dialect.name == "postgresql" else None


def _segment_key(name: str) -> sa.Column[int]:
    schema = _schema()
    target = f"{schema}.segments.id" if schema else "segments.id"
    return sa.Column(
        "segment_id", _SEGMENT_KEY, sa.ForeignKey(target, ondelete="CASCADE", name=name), primary_key=True
    )


def upgrade() -> None:
    schema = _schema()
    prefix = f"{schema}." if schema else ""
    op.create_table(
        "segment_vectors",
        _segment_key("fk_memory_segment_vectors_segment"),
        sa.Column("embedding", sa.LargeBinary, nullable=False),
        schema=schema,
    )
    op.create_table(
        "unembedded",
        _segment_key("fk_memory_unembedded_segment"),
        sa.Column("agent_id", sa.String(128), nullable=False),
        sa.Column("workspace_id", sa.String(128), nullable=False),
        schema=schema,
    )
    op.execute(
        f"INSERT INTO {prefix}segment_vectors (segment_id, embedding)"
        f" SELECT id, embedding FROM {prefix}segments WHERE embedding IS NOT NULL"
    )
    op.execute(
        f"INSERT INTO {prefix}unembedded (segment_id, agent_id, workspace_id)"
        f" SELECT id, agent_id, workspace_id FROM {prefix}segments WHERE embedding IS NULL"
    )
    for name in _PENDING_INDEXES:
        op.drop_index(name, table_name="segments", schema=schema)
    # Plain ALTER (SQLite 3.35+): a batch copy of the table would drop the
    # original, and the cascade with it would empty the new tables.
    op.execute(f"ALTER TABLE {prefix}segments DROP COLUMN embedding")


def downgrade() -> None:
    schema = _schema()
    prefix = f"{schema}." if schema else ""
    op.add_column("segments", sa.Column("embedding", sa.LargeBinary, nullable=True), schema=schema)
    op.execute(
        f"UPDATE {prefix}segments SET embedding = (SELECT v.embedding FROM {prefix}segment_vectors v"
        f" WHERE v.segment_id = {prefix}segments.id)"
    )
    for name, column in _PENDING_INDEXES.items():
        op.create_index(
            name,
            "segments",
            [column],
            schema=schema,
            postgresql_where=sa.text("embedding IS NULL"),
            sqlite_where=sa.text("embedding IS NULL"),
        )
    op.drop_table("unembedded", schema=schema)
    op.drop_table("segment_vectors", schema=schema)
