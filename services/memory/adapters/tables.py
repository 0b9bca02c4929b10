"""The memory's tables (SQLAlchemy Core). On PostgreSQL they live in the
`memory` schema; on SQLite the schema is translated away (see `SqlDatabase`),
so one file can hold every service's tables.

Lexical indexes are not in this metadata, being backend-specific: SQLite has
the FTS5 table `segment_fts` (rowid = segment id, column `terms`), and
PostgreSQL a generated `tsv` column on `segments` with a GIN index (see the
first migration).
"""

from __future__ import annotations

import sqlalchemy as sa

from services.common.sql import UtcDateTime

SCHEMA = "memory"

metadata = sa.MetaData(schema=SCHEMA)

# SQLite's rowid alias must be INTEGER; PostgreSQL gets a 64-bit identity.
SegmentKey = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

runs = sa.Table(
    "runs",
    metadata,
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
    sa.Index("ix_memory_runs_agent", "agent_id"),
    sa.Index("ix_memory_runs_workspace", "workspace_id"),
    sa.Index("ix_memory_runs_session", "session_id"),
)

segments = sa.Table(
    "segments",
    metadata,
    sa.Column("id", SegmentKey, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("workspace_id", sa.String(128), nullable=False),
    sa.Column("agent_id", sa.String(128), nullable=False),
    sa.Column("session_id", sa.String(128), nullable=False),
    sa.Column("step_sequence", sa.BigInteger, nullable=False),
    sa.Column("segment_index", sa.Integer, nullable=False),
    sa.Column("type", sa.SmallInteger, nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    sa.Column("tool_name", sa.String(256), nullable=False),
    # '' for a task's segment (no conversation, no audience).
    sa.Column("group_id", sa.String(128), nullable=False),
    sa.Column("audience_id", sa.String(32), nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("language", sa.String(8), nullable=False),
    sa.Column("dedup_key", sa.String(32), nullable=False),
    # `lexical_terms(text)` joined by spaces: what both lexical indexes hold.
    sa.Column("terms", sa.Text, nullable=False),
    sa.Column("term_count", sa.Integer, nullable=False),
    sa.UniqueConstraint("run_id", "step_sequence", "segment_index", name="uq_memory_segments_anchor"),
    sa.Index("ix_memory_segments_agent", "agent_id", "created_at"),
    sa.Index("ix_memory_segments_workspace", "workspace_id", "created_at"),
    sa.Index("ix_memory_segments_session", "session_id"),
)

# Segments' vectors, apart from the segments: storing one then writes a narrow
# row of its own instead of rewriting the segment with all its index entries
# (PostgreSQL's GIN included), and segment rows stay small for lexical search.
segment_vectors = sa.Table(
    "segment_vectors",
    metadata,
    sa.Column(
        "segment_id",
        SegmentKey,
        sa.ForeignKey("segments.id", ondelete="CASCADE", name="fk_memory_segment_vectors_segment"),
        primary_key=True,
    ),
    # float32 little-endian, unit length.
    sa.Column("embedding", sa.LargeBinary, nullable=False),
)

# The background embedder's queue: the segments still without a vector. It
# is short (what was archived in the last moments), so it needs no index but
# its key: counting one scope's rows in it reads it whole.
unembedded = sa.Table(
    "unembedded",
    metadata,
    sa.Column(
        "segment_id",
        SegmentKey,
        sa.ForeignKey("segments.id", ondelete="CASCADE", name="fk_memory_unembedded_segment"),
        primary_key=True,
    ),
    sa.Column("agent_id", sa.String(128), nullable=False),
    sa.Column("workspace_id", sa.String(128), nullable=False),
)

# The members of each audience (a conversation's members as archived).
audience_members = sa.Table(
    "audience_members",
    metadata,
    sa.Column("audience_id", sa.String(32), primary_key=True),
    sa.Column("member_id", sa.String(128), primary_key=True),
    sa.Index("ix_memory_audience_members_member", "member_id", "audience_id"),
)

# Bumped at every write of an agent's or a workspace's segments, so that
# each replica's cached vector matrix knows when it is stale.
scope_versions = sa.Table(
    "scope_versions",
    metadata,
    sa.Column("scope", sa.String(160), primary_key=True),
    sa.Column("version", sa.BigInteger, nullable=False),
)

# Running sums of stored vectors per language, for centering (see ranking.LanguageMeans).
language_means = sa.Table(
    "language_means",
    metadata,
    sa.Column("language", sa.String(8), primary_key=True),
    sa.Column("count", sa.BigInteger, nullable=False),
    # float64 little-endian sums.
    sa.Column("sums", sa.LargeBinary, nullable=False),
)
