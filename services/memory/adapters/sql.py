"""The memory's storage on SQLite (aiosqlite, WAL, FTS5) or PostgreSQL (asyncpg, GIN).

`SqlMemoryStore` implements the `MemoryStore` port with SQLAlchemy Core; each
method runs in one short transaction of its own. Searching is in `search`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from services.common.outages import DATABASE, as_unavailable
from services.common.sql import SqlDatabase
from services.memory.adapters import search
from services.memory.adapters.tables import (
    SCHEMA,
    audience_members,
    language_means,
    runs,
    scope_versions,
    segments,
)
from services.memory.domain.audience import audience_id
from services.memory.domain.duplicates import dedup_key
from services.memory.domain.errors import NotAllowed
from services.memory.domain.model import (
    ArchivedRun,
    MemoryStats,
    Ref,
    RunInfo,
    SegmentDraft,
    SegmentType,
    StoredSegment,
)
from services.memory.domain.ranking import Hit
from services.memory.domain.scope import Filters, ForgetTarget, Scope
from services.memory.domain.terms import language_of, lexical_terms
from services.memory.service_layer.ports import AgentIdentity, MemoryStore, PendingSegment, Vector

logger = logging.getLogger(__name__)

# The execution option that marks a writer's connection (BEGIN IMMEDIATE on SQLite).
_WRITE = "memory_write"
_SEGMENT_COLUMNS = (
    segments.c.id,
    segments.c.workspace_id,
    segments.c.agent_id,
    segments.c.session_id,
    segments.c.run_id,
    segments.c.step_sequence,
    segments.c.segment_index,
    segments.c.type,
    segments.c.text,
    segments.c.tool_name,
    segments.c.group_id,
    segments.c.created_at,
    segments.c.dedup_key,
)


class Database(SqlDatabase):
    """The memory's engine (schema `memory`)."""

    def __init__(self, url: str, *, pool_size: int = 8, busy_timeout_seconds: float = 10.0) -> None:
        super().__init__(
            url,
            schema=SCHEMA,
            write_option=_WRITE,
            pool_size=pool_size,
            busy_timeout_seconds=busy_timeout_seconds,
        )

    @contextlib.asynccontextmanager
    async def transaction(self, *, write: bool = True) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction that commits when the block ends and rolls back if it raises.

        Raises:
            DependencyUnavailable: the database cannot serve.
        """
        with as_unavailable(DATABASE):
            async with contextlib.AsyncExitStack() as stack:
                if self.is_sqlite and write:
                    await stack.enter_async_context(self.write_lock)
                conn = await stack.enter_async_context(self.engine.connect())
                if write:
                    conn = await conn.execution_options(**{_WRITE: True})
                elif not self.is_sqlite:
                    conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                async with conn.begin():
                    yield conn


def _segment(row: Any) -> StoredSegment:
    return StoredSegment(
        key=int(row.id),
        workspace_id=row.workspace_id,
        agent_id=row.agent_id,
        session_id=row.session_id,
        run_id=row.run_id,
        step_sequence=int(row.step_sequence),
        segment_index=int(row.segment_index),
        type=SegmentType(row.type),
        text=row.text,
        tool_name=row.tool_name,
        group_id=row.group_id,
        created_at=row.created_at,
        dedup_key=row.dedup_key,
    )


class SqlMemoryStore(MemoryStore):
    """`MemoryStore` on a SQL database.

    Args:
        database: the engine.
        dimensions: the embedder's vector size.
        common_term_docs: on PostgreSQL, query terms found in more segments
            than this are left out of lexical search (see `search`).
        cached_scopes: vector matrices kept in memory at once.
        clock: the current time (archive times).
    """

    def __init__(
        self,
        database: Database,
        *,
        dimensions: int,
        common_term_docs: int = 5000,
        cached_scopes: int = 64,
    ) -> None:
        self._db = database
        self._common_term_docs = common_term_docs
        self.vectors = search.VectorIndex(dimensions, max_scopes=cached_scopes)
        self.dimensions = dimensions

    async def aclose(self) -> None:
        await self._db.aclose()

    # -- writing ------------------------------------------------------------

    def _upsert(self, table: sa.Table) -> Any:
        return (sqlite.insert if self._db.is_sqlite else postgresql.insert)(table)

    async def _bump(self, conn: AsyncConnection, keys: set[str]) -> None:
        for key in sorted(keys):
            statement = self._upsert(scope_versions).values(scope=key, version=1)
            await conn.execute(
                statement.on_conflict_do_update(
                    index_elements=[scope_versions.c.scope], set_={"version": scope_versions.c.version + 1}
                )
            )

    async def archive(self, run: ArchivedRun, drafts: Sequence[SegmentDraft], content_hash: str) -> bool:
        try:
            return await self._archive(run, drafts, content_hash)
        except sa.exc.IntegrityError:
            # The same new run archived twice at once: the other one won, so
            # this one now finds it stored (as it is, or to be replaced).
            logger.info("run %s was archived concurrently; archiving again", run.run_id)
            return await self._archive(run, drafts, content_hash)

    async def _archive(self, run: ArchivedRun, drafts: Sequence[SegmentDraft], content_hash: str) -> bool:
        now = datetime.now(UTC)
        audiences = {group: audience_id(members) for group, members in run.conversations.items()}
        async with self._db.transaction() as conn:
            query = sa.select(runs.c.workspace_id, runs.c.agent_id, runs.c.content_hash).where(
                runs.c.run_id == run.run_id
            )
            if not self._db.is_sqlite:
                query = query.with_for_update()
            existing = (await conn.execute(query)).first()
            values = {
                "workspace_id": run.workspace_id,
                "agent_id": run.agent_id,
                "agent_member_id": run.agent_member_id,
                "session_id": run.session_id,
                "started_at": run.started_at,
                "ended_at": run.ended_at,
                "content_hash": content_hash,
                "segment_count": len(drafts),
                "archived_at": now,
            }
            if existing is not None:
                if (existing.workspace_id, existing.agent_id) != (run.workspace_id, run.agent_id):
                    raise NotAllowed(f"run {run.run_id} belongs to another agent")
                if existing.content_hash == content_hash:
                    return False
                await self._delete_segments(conn, segments.c.run_id == run.run_id)
                await conn.execute(runs.update().where(runs.c.run_id == run.run_id).values(**values))
            else:
                await conn.execute(runs.insert().values(run_id=run.run_id, **values))
            for group, members in run.conversations.items():
                rows = [{"audience_id": audiences[group], "member_id": member} for member in sorted(members)]
                await conn.execute(self._upsert(audience_members).values(rows).on_conflict_do_nothing())
            if drafts:
                await conn.execute(segments.insert(), [self._segment_row(run, d, audiences) for d in drafts])
                if self._db.is_sqlite:
                    await conn.execute(
                        sa.text(
                            "INSERT INTO segment_fts (rowid, terms)"
                            " SELECT id, terms FROM segments WHERE run_id = :r"
                        ),
                        {"r": run.run_id},
                    )
            await self._bump(conn, {f"agent:{run.agent_id}", f"workspace:{run.workspace_id}"})
        return True

    @staticmethod
    def _segment_row(run: ArchivedRun, draft: SegmentDraft, audiences: dict[str, str]) -> dict[str, Any]:
        terms = lexical_terms(draft.text)
        return {
            "run_id": run.run_id,
            "workspace_id": run.workspace_id,
            "agent_id": run.agent_id,
            "session_id": run.session_id,
            "step_sequence": draft.step_sequence,
            "segment_index": draft.segment_index,
            "type": int(draft.type),
            "text": draft.text,
            "tool_name": draft.tool_name,
            "group_id": draft.group_id,
            "audience_id": audiences.get(draft.group_id, "") if draft.group_id else "",
            "created_at": draft.created_at,
            "language": language_of(draft.text),
            "dedup_key": dedup_key(draft.text),
            "terms": " ".join(terms),
            "term_count": len(terms),
            "embedding": None,
        }

    async def _delete_segments(self, conn: AsyncConnection, where: sa.ColumnElement[bool]) -> int:
        if self._db.is_sqlite:
            await conn.execute(
                sa.delete(search.segment_fts).where(
                    search.segment_fts.c.rowid.in_(sa.select(segments.c.id).where(where))
                )
            )
        result = await conn.execute(segments.delete().where(where))
        return int(result.rowcount or 0)

    async def forget(self, target: ForgetTarget) -> int:
        where: list[sa.ColumnElement[bool]] = []
        run_where: list[sa.ColumnElement[bool]] = []
        for name in ("run_id", "session_id", "agent_id", "workspace_id"):
            value = getattr(target, name)
            if value:
                where.append(segments.c[name] == value)
                run_where.append(runs.c[name] == value)
        if target.before is not None:
            where.append(segments.c.created_at < target.before)
        condition = sa.and_(sa.true(), *where)
        async with self._db.transaction() as conn:
            affected = (
                await conn.execute(
                    sa.select(segments.c.agent_id, segments.c.workspace_id, segments.c.run_id)
                    .where(condition)
                    .distinct()
                )
            ).all()
            deleted = await self._delete_segments(conn, condition)
            emptied = {row.run_id for row in affected}
            orphans = sa.not_(sa.exists().where(segments.c.run_id == runs.c.run_id))
            if emptied:
                await conn.execute(runs.delete().where(runs.c.run_id.in_(sorted(emptied)), orphans))
            if target.before is None and run_where:
                await conn.execute(runs.delete().where(*run_where, orphans))
            keys = {f"agent:{row.agent_id}" for row in affected} | {
                f"workspace:{row.workspace_id}" for row in affected
            }
            await self._bump(conn, keys)
        return deleted

    async def store_embeddings(
        self, pending: Sequence[PendingSegment], vectors: npt.NDArray[np.float32]
    ) -> int:
        if len(pending) != len(vectors):
            raise ValueError("one vector per pending segment")
        sums: dict[str, npt.NDArray[np.float64]] = {}
        counts: dict[str, int] = {}
        stored: list[int] = []
        async with self._db.transaction() as conn:
            for item, vector in zip(pending, vectors, strict=True):
                blob = np.asarray(vector, dtype="<f4").tobytes()
                result = await conn.execute(
                    segments.update()
                    .where(segments.c.id == item.key, segments.c.embedding.is_(None))
                    .values(embedding=blob)
                )
                if result.rowcount:
                    stored.append(item.key)
                    sums.setdefault(item.language, np.zeros(self.dimensions, dtype=np.float64))
                    sums[item.language] += np.asarray(vector, dtype=np.float64)
                    counts[item.language] = counts.get(item.language, 0) + 1
            for language, added in sums.items():
                query = sa.select(language_means).where(language_means.c.language == language)
                if not self._db.is_sqlite:
                    query = query.with_for_update()
                row = (await conn.execute(query)).first()
                if row is None:
                    await conn.execute(
                        language_means.insert().values(
                            language=language, count=counts[language], sums=added.astype("<f8").tobytes()
                        )
                    )
                else:
                    before = np.frombuffer(row.sums, dtype="<f8")
                    total, count = added, counts[language]
                    if len(before) == self.dimensions:
                        total, count = added + before, count + int(row._mapping["count"])
                    # else: sums of another embedder's vectors, which no search uses any more.
                    await conn.execute(
                        language_means.update()
                        .where(language_means.c.language == language)
                        .values(count=count, sums=total.astype("<f8").tobytes())
                    )
            if stored:
                owners = (
                    await conn.execute(
                        sa.select(segments.c.agent_id, segments.c.workspace_id)
                        .where(segments.c.id.in_(stored))
                        .distinct()
                    )
                ).all()
                keys = {f"agent:{row.agent_id}" for row in owners} | {
                    f"workspace:{row.workspace_id}" for row in owners
                }
                await self._bump(conn, keys)
        return len(stored)

    # -- reading ------------------------------------------------------------

    async def _read(self, statement: sa.Executable) -> Any:
        async def read() -> Any:
            async with self._db.transaction(write=False) as conn:
                return (await conn.execute(statement)).all()

        return await self._db.retry_read(read)

    async def agent_identity(self, agent_id: str) -> AgentIdentity | None:
        rows = await self._read(
            sa.select(runs.c.workspace_id, runs.c.agent_member_id).where(runs.c.agent_id == agent_id).limit(1)
        )
        return AgentIdentity(rows[0].workspace_id, rows[0].agent_member_id) if rows else None

    async def run_info(self, run_id: str) -> RunInfo | None:
        count = sa.select(sa.func.count()).where(segments.c.run_id == run_id).scalar_subquery()
        rows = await self._read(sa.select(runs, count.label("live_count")).where(runs.c.run_id == run_id))
        if not rows:
            return None
        row = rows[0]
        return RunInfo(
            run_id=row.run_id,
            workspace_id=row.workspace_id,
            agent_id=row.agent_id,
            agent_member_id=row.agent_member_id,
            session_id=row.session_id,
            started_at=row.started_at,
            ended_at=row.ended_at,
            segment_count=int(row.live_count),
        )

    async def segments(self, keys: Sequence[int]) -> dict[int, StoredSegment]:
        if not keys:
            return {}
        rows = await self._read(sa.select(*_SEGMENT_COLUMNS).where(segments.c.id.in_(sorted(set(keys)))))
        return {int(row.id): _segment(row) for row in rows}

    async def lexical_search(
        self, scope: Scope, filters: Filters, terms: Sequence[str], limit: int
    ) -> list[Hit]:
        async def read() -> list[Hit]:
            async with self._db.transaction(write=False) as conn:
                if self._db.is_sqlite:
                    return await search.lexical_sqlite(conn, scope, filters, terms, limit)
                return await search.lexical_postgres(
                    conn, scope, filters, terms, limit, common_term_docs=self._common_term_docs
                )

        return await self._db.retry_read(read)

    async def term_rarity(self, terms: Sequence[str]) -> dict[str, float]:
        async def read() -> dict[str, float]:
            async with self._db.transaction(write=False) as conn:
                if self._db.is_sqlite:
                    return await search.term_rarity_sqlite(conn, terms)
                return await search.term_rarity_postgres(conn, terms)

        return await self._db.retry_read(read)

    async def vector_search(
        self, scope: Scope, filters: Filters, query: Vector, language: str, limit: int
    ) -> list[Hit]:
        async def read() -> list[Hit]:
            async with self._db.transaction(write=False) as conn:
                return await self.vectors.search(
                    conn, scope, filters=filters, query=query, language=language, limit=limit
                )

        return await self._db.retry_read(read)

    async def visible_segment(self, scope: Scope, ref: Ref) -> StoredSegment | None:
        rows = await self._read(
            sa.select(*_SEGMENT_COLUMNS).where(
                segments.c.run_id == ref.run_id,
                segments.c.step_sequence == ref.step_sequence,
                segments.c.segment_index == ref.segment_index,
                *search.conditions(scope, Filters()),
            )
        )
        return _segment(rows[0]) if rows else None

    async def neighbours(
        self, scope: Scope, focus: StoredSegment, *, before: int, after: int
    ) -> tuple[list[StoredSegment], list[StoredSegment]]:
        where = [segments.c.run_id == focus.run_id, *search.conditions(scope, Filters())]
        position = sa.tuple_(segments.c.step_sequence, segments.c.segment_index)
        here = sa.tuple_(sa.literal(focus.step_sequence), sa.literal(focus.segment_index))
        earlier = await self._read(
            sa.select(*_SEGMENT_COLUMNS)
            .where(*where, position < here)
            .order_by(segments.c.step_sequence.desc(), segments.c.segment_index.desc())
            .limit(before)
        )
        later = await self._read(
            sa.select(*_SEGMENT_COLUMNS)
            .where(*where, position > here)
            .order_by(segments.c.step_sequence, segments.c.segment_index)
            .limit(after)
        )
        return [_segment(row) for row in reversed(earlier)], [_segment(row) for row in later]

    async def pending_count(self, scope: Scope | None = None) -> int:
        # Counted for the whole scope, not per audience: the audience rule's
        # join would cost a scan of the scope (35 ms at 20k segments), where
        # the partial indexes hold only what waits.
        where: list[sa.ColumnElement[bool]] = [segments.c.embedding.is_(None)]
        if scope is not None:
            where.append(segments.c.workspace_id == scope.workspace_id)
            if scope.agent_id is not None:
                where.append(segments.c.agent_id == scope.agent_id)
        rows = await self._read(sa.select(sa.func.count()).select_from(segments).where(*where))
        return int(rows[0][0])

    async def target_workspaces(self, target: ForgetTarget) -> set[str]:
        if target.workspace_id:
            return {target.workspace_id}
        where = [
            runs.c[name] == getattr(target, name)
            for name in ("run_id", "session_id", "agent_id")
            if getattr(target, name)
        ]
        if not where:
            return set()
        rows = await self._read(sa.select(runs.c.workspace_id).where(*where).distinct())
        return {row.workspace_id for row in rows}

    async def stats(self, *, agent_id: str = "", workspace_id: str = "") -> MemoryStats:
        run_where = runs.c.agent_id == agent_id if agent_id else runs.c.workspace_id == workspace_id
        segment_where = (
            segments.c.agent_id == agent_id if agent_id else segments.c.workspace_id == workspace_id
        )
        run_count = sa.select(sa.func.count()).select_from(runs).where(run_where).scalar_subquery()
        rows = await self._read(
            sa.select(
                run_count.label("runs"),
                sa.func.count().label("segments"),
                sa.func.count().filter(segments.c.embedding.is_(None)).label("pending"),
                sa.func.min(segments.c.created_at).label("oldest"),
                sa.func.max(segments.c.created_at).label("newest"),
            ).where(segment_where)
        )
        row = rows[0]
        return MemoryStats(
            run_count=int(row.runs),
            segment_count=int(row.segments),
            pending_embeddings=int(row.pending or 0),
            oldest=_aware(row.oldest),
            newest=_aware(row.newest),
        )

    async def pending_embeddings(self, limit: int) -> list[PendingSegment]:
        rows = await self._read(
            sa.select(segments.c.id, segments.c.text, segments.c.language)
            .where(segments.c.embedding.is_(None))
            .order_by(segments.c.id)
            .limit(limit)
        )
        return [PendingSegment(int(row.id), row.text, row.language) for row in rows]


def _aware(value: Any) -> datetime | None:
    # min()/max() over the column come back untyped on SQLite (text).
    if value is None:
        return None
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
