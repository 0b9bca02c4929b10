"""The memory's first schema: runs, segments with their lexical index, audiences,
scope versions and per-language vector sums.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "memory" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("workspace_id", sa.String(128), nullable=False),
        sa.Column("agent_id", sa.String(128), nullable=False),
        sa.Column("agent_member_id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("started_at", UtcDateTime, nullable=False),
        sa.Column("ended_at", UtcDateTime, nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("segment_count", sa.Integer, nullable=False),
        sa.Column("archived_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_index("ix_memory_runs_agent", "runs", ["agent_id"], schema=schema)
    op.create_index("ix_memory_runs_workspace", "runs", ["workspace_id"], schema=schema)
    op.create_index("ix_memory_runs_session", "runs", ["session_id"], schema=schema)
    op.create_table(
        "segments",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("workspace_id", sa.String(128), nullable=False),
        sa.Column("agent_id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("step_sequence", sa.BigInteger, nullable=False),
        sa.Column("segment_index", sa.Integer, nullable=False),
        sa.Column("type", sa.SmallInteger, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("tool_name", sa.String(256), nullable=False),
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("audience_id", sa.String(32), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("language", sa.String(8), nullable=False),
        sa.Column("dedup_key", sa.String(32), nullable=False),
        sa.Column("terms", sa.Text, nullable=False),
        sa.Column("term_count", sa.Integer, nullable=False),
        sa.Column("embedding", sa.LargeBinary, nullable=True),
        sa.UniqueConstraint("run_id", "step_sequence", "segment_index", name="uq_memory_segments_anchor"),
        schema=schema,
    )
    op.create_index("ix_memory_segments_agent", "segments", ["agent_id", "created_at"], schema=schema)
    op.create_index("ix_memory_segments_workspace", "segments", ["workspace_id", "created_at"], schema=schema)
    op.create_index("ix_memory_segments_session", "segments", ["session_id"], schema=schema)
    # The background embedder's queue: only the rows still without a vector.
    op.create_index(
        "ix_memory_segments_unembedded",
        "segments",
        ["id"],
        schema=schema,
        postgresql_where=sa.text("embedding IS NULL"),
        sqlite_where=sa.text("embedding IS NULL"),
    )
    op.create_table(
        "audience_members",
        sa.Column("audience_id", sa.String(32), primary_key=True),
        sa.Column("member_id", sa.String(128), primary_key=True),
        schema=schema,
    )
    op.create_index(
        "ix_memory_audience_members_member", "audience_members", ["member_id", "audience_id"], schema=schema
    )
    op.create_table(
        "scope_versions",
        sa.Column("scope", sa.String(160), primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        schema=schema,
    )
    op.create_table(
        "language_means",
        sa.Column("language", sa.String(8), primary_key=True),
        sa.Column("count", sa.BigInteger, nullable=False),
        sa.Column("sums", sa.LargeBinary, nullable=False),
        schema=schema,
    )
    if schema is None:
        # Terms arrive already cut (see domain.terms) and joined by spaces:
        # the tokenizer must split on spaces alone, so the characters that
        # identifiers keep (`err_quota_42`, `services/im/x.py`) are token
        # characters; CJK bigrams are letters to unicode61 already.
        op.execute(
            "CREATE VIRTUAL TABLE segment_fts USING fts5("
            "terms, tokenize = \"unicode61 remove_diacritics 0 tokenchars '_./:-'\")"
        )
    else:
        # array_to_tsvector keeps each term as it is (to_tsvector's parser
        # would cut `err_quota_42` into three words).
        op.execute(
            "ALTER TABLE memory.segments ADD COLUMN tsv tsvector "
            "GENERATED ALWAYS AS (array_to_tsvector(string_to_array(terms, ' '))) STORED"
        )
        op.execute("CREATE INDEX ix_memory_segments_tsv ON memory.segments USING gin (tsv)")


def downgrade() -> None:
    schema = _schema()
    if schema is None:
        op.execute("DROP TABLE segment_fts")
    for table in ("language_means", "scope_versions", "audience_members", "segments", "runs"):
        op.drop_table(table, schema=schema)
