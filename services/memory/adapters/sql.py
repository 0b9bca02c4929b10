"""The memory's storage on SQLite (aiosqlite, WAL, FTS5) or PostgreSQL (asyncpg, GIN).

`SqlMemoryStore` implements the `MemoryStore` port with SQLAlchemy Core; each
method runs in one short transaction of its own. Searching is in `search`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
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
from services.memory.adapters.pgvector import PgVectorIndex, PgVectorUnavailable, find_extension
from services.memory.adapters.tables import (
    SCHEMA,
    audience_members,
    language_means,
    runs,
    scope_versions,
    segment_vectors,
    segments,
    unembedded,
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
from services.memory.domain.ranking import (
    DEFAULT_LEXICAL_POSTINGS,
    Hit,
    LanguageMeans,
    rarity,
    selective_terms,
)
from services.memory.domain.scope import Filters, ForgetTarget, Scope, scopes_of
from services.memory.domain.terms import language_of, lexical_terms
from services.memory.service_layer.ports import AgentIdentity, MemoryStore, PendingSegment, Vector

logger = logging.getLogger(__name__)

# Agents whose identity (workspace, member id) is kept in memory at once.
_KNOWN_AGENTS = 10_000
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
    async def transaction(
        self, *, write: bool = True, set_local: bool = False
    ) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction that commits when the block ends and rolls back if it raises.

        Reads on PostgreSQL run without one (autocommit, each statement sees
        what is committed), unless `set_local`: a read that changes settings
        for itself (`SET LOCAL`, pgvector's search settings) needs a real one.

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
                elif not self.is_sqlite and not set_local:
                    conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                async with conn.begin():
                    yield conn


@dataclass(eq=False)
class _PendingArchive:
    """A run waiting for the archive writer, and its caller's future."""

    run: ArchivedRun
    drafts: Sequence[SegmentDraft]
    content_hash: str
    done: asyncio.Future[bool]

    def settle(self, outcome: bool | Exception) -> None:
        if self.done.done():
            return  # the caller gave up waiting (cancelled); the write stands
        if isinstance(outcome, Exception):
            self.done.set_exception(outcome)
        else:
            self.done.set_result(outcome)


def _segment(row: Any, terms: str = "") -> StoredSegment:
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
        terms=terms,
    )


class SqlMemoryStore(MemoryStore):
    """`MemoryStore` on a SQL database.

    Args:
        database: the engine.
        dimensions: the embedder's vector size.
        lexical_postings: lexical search ranks the segments of a query's
            rarest terms, as many terms as hold no more than this many
            segments together (see `ranking.selective_terms`).
        cached_scopes: vector matrices kept in memory at once.
        approximate_from_rows: a scope with this many embedded segments is
            searched through an approximate index (0: always exactly).
        probe_share: the share of that index's lists a search scores.
        archive_batch_runs: runs waiting to be archived at the same moment
            that are written in one transaction, at most.
        pgvector: on PostgreSQL, `auto` searches vectors with pgvector (an
            HNSW index, see `adapters.pgvector`) when `start` finds the
            extension or may create it, `on` requires it, `off` never uses
            it; otherwise, and on SQLite, vectors are searched in numpy.
        ef_search: pgvector's `hnsw.ef_search` (candidates kept while the
            index is searched).
    """

    def __init__(
        self,
        database: Database,
        *,
        dimensions: int,
        lexical_postings: int = DEFAULT_LEXICAL_POSTINGS,
        cached_scopes: int = 64,
        approximate_from_rows: int = 200_000,
        probe_share: float = 0.025,
        archive_batch_runs: int = 64,
        pgvector: str = "off",
        ef_search: int = 100,
    ) -> None:
        self._db = database
        self._pgvector_mode = pgvector
        self._ef_search = ef_search
        # Vector search in PostgreSQL, once `start` found pgvector.
        self.pgvector: PgVectorIndex | None = None
        self._lexical_postings = lexical_postings
        self.term_frequencies = search.TermFrequencies(cap=lexical_postings + 1, sqlite=database.is_sqlite)
        self.vectors = search.VectorIndex(
            dimensions,
            max_scopes=cached_scopes,
            approximate_from_rows=approximate_from_rows,
            probe_share=probe_share,
        )
        self.dimensions = dimensions
        self._archive_batch_runs = archive_batch_runs
        self._archive_queue: list[_PendingArchive] = []
        self._archive_writer: asyncio.Task[None] | None = None
        self._identities: OrderedDict[str, AgentIdentity] = OrderedDict()
        # Transactions that archived runs (several runs each under load).
        self.archive_transactions = 0

    async def start(self) -> None:
        """On PostgreSQL (unless pgvector is off): finds pgvector, or creates
        it if the server has it and this role may, and prepares its column
        and index; starts the job that keeps the index's vectors centered.

        Raises:
            PgVectorUnavailable: pgvector is `on` and cannot be had.
            DependencyUnavailable: the database cannot serve.
        """
        if self._db.is_sqlite or self._pgvector_mode == "off" or self.pgvector is not None:
            return
        async with self._db.transaction() as conn:
            if await conn.scalar(sa.text(f"SELECT to_regclass('{SCHEMA}.segment_vectors')")) is None:
                extension, reason = None, "the memory's tables are missing (run its migrations first)"
            else:
                extension, reason = await find_extension(conn)
        if extension is None:
            if self._pgvector_mode == "on":
                raise PgVectorUnavailable(f"MEMORY_PGVECTOR=on, but {reason}")
            logger.info("vectors are searched in numpy: %s", reason)
            return
        index = PgVectorIndex(
            self._db, dimensions=self.dimensions, extension=extension, ef_search=self._ef_search
        )
        await index.prepare()
        index.start()
        self.pgvector = index
        logger.info(
            "vectors are searched in PostgreSQL: pgvector %s, HNSW index%s",
            extension.version_text,
            ", iterative scans" if extension.iterative_scan else " (no iterative scans before 0.8.0)",
        )

    async def aclose(self) -> None:
        if self._archive_writer is not None:
            # Archives already accepted are written before the engine goes.
            await self._archive_writer
        if self.pgvector is not None:
            await self.pgvector.aclose()
        await self.term_frequencies.aclose()
        await self.vectors.aclose()
        await self._db.aclose()

    # -- writing ------------------------------------------------------------

    def _upsert(self, table: sa.Table) -> Any:
        return (sqlite.insert if self._db.is_sqlite else postgresql.insert)(table)

    async def _bump(self, conn: AsyncConnection, keys: set[str]) -> None:
        if not keys:
            return
        statement = self._upsert(scope_versions).values(
            [{"scope": key, "version": 1} for key in sorted(keys)]
        )
        await conn.execute(
            statement.on_conflict_do_update(
                index_elements=[scope_versions.c.scope], set_={"version": scope_versions.c.version + 1}
            )
        )

    async def archive(self, run: ArchivedRun, drafts: Sequence[SegmentDraft], content_hash: str) -> bool:
        """Archives the run together with whatever other runs are waiting to be
        archived at the same moment: one transaction for them all (group commit)."""
        item = _PendingArchive(run, drafts, content_hash, asyncio.get_running_loop().create_future())
        self._archive_queue.append(item)
        if self._archive_writer is None or self._archive_writer.done():
            self._archive_writer = asyncio.create_task(self._write_archives(), name="memory-archive-writer")
        return await item.done

    async def _write_archives(self) -> None:
        while self._archive_queue:
            batch = self._archive_queue[: self._archive_batch_runs]
            del self._archive_queue[: len(batch)]
            if len(batch) > 1:
                try:
                    outcomes, again = await self._archive_together(batch)
                except Exception as error:
                    # A race with another replica, or an outage: each run alone,
                    # so that one run's trouble is not the others'.
                    logger.info("archiving %d runs together failed (%s); one by one", len(batch), error)
                else:
                    for item, outcome in outcomes.items():
                        item.settle(outcome)
                    self._archive_queue[:0] = again
                    continue
            for item in batch:
                try:
                    outcome = await self._archive_alone(item)
                except Exception as error:
                    outcome = error
                item.settle(outcome)

    async def _archive_alone(self, item: _PendingArchive) -> bool | Exception:
        try:
            outcomes, _ = await self._archive_together([item])
        except sa.exc.IntegrityError:
            # The same new run archived twice at once (by another replica): the
            # other one won, so this one now finds it stored (as it is, or to be replaced).
            logger.info("run %s was archived concurrently; archiving again", item.run.run_id)
            outcomes, _ = await self._archive_together([item])
        return outcomes[item]

    async def _archive_together(
        self, batch: Sequence[_PendingArchive]
    ) -> tuple[dict[_PendingArchive, bool | Exception], list[_PendingArchive]]:
        """Writes the runs of `batch` in one transaction. Returns each run's
        outcome (changed, unchanged or refused) and the runs left for another
        transaction (a second archive of a run already in this one)."""
        now = datetime.now(UTC)
        outcomes: dict[_PendingArchive, bool | Exception] = {}
        again: list[_PendingArchive] = []
        self.archive_transactions += 1
        async with self._db.transaction() as conn:
            query = sa.select(runs.c.run_id, runs.c.workspace_id, runs.c.agent_id, runs.c.content_hash).where(
                runs.c.run_id.in_(sorted({item.run.run_id for item in batch}))
            )
            if not self._db.is_sqlite:
                query = query.with_for_update()
            existing = {row.run_id: row for row in (await conn.execute(query)).all()}
            written: dict[str, _PendingArchive] = {}
            replaced: list[str] = []
            for item in batch:
                run = item.run
                if run.run_id in written:
                    again.append(item)
                    continue
                found = existing.get(run.run_id)
                if found is not None and (found.workspace_id, found.agent_id) != (
                    run.workspace_id,
                    run.agent_id,
                ):
                    outcomes[item] = NotAllowed(f"run {run.run_id} belongs to another agent")
                elif found is not None and found.content_hash == item.content_hash:
                    outcomes[item] = False
                else:
                    if found is not None:
                        replaced.append(run.run_id)
                    written[run.run_id] = item
                    outcomes[item] = True
            if not written:
                return outcomes, again
            if replaced:
                await self._delete_segments(conn, segments.c.run_id.in_(replaced))
                await conn.execute(runs.delete().where(runs.c.run_id.in_(replaced)))
            await conn.execute(
                runs.insert(),
                [
                    {
                        "run_id": item.run.run_id,
                        "workspace_id": item.run.workspace_id,
                        "agent_id": item.run.agent_id,
                        "agent_member_id": item.run.agent_member_id,
                        "session_id": item.run.session_id,
                        "started_at": item.run.started_at,
                        "ended_at": item.run.ended_at,
                        "content_hash": item.content_hash,
                        "segment_count": len(item.drafts),
                        "archived_at": now,
                    }
                    for item in written.values()
                ],
            )
            members: set[tuple[str, str]] = set()
            rows: list[dict[str, Any]] = []
            for item in written.values():
                audiences = {group: audience_id(people) for group, people in item.run.conversations.items()}
                members |= {
                    (audiences[group], member)
                    for group, people in item.run.conversations.items()
                    for member in people
                }
                rows += [self._segment_row(item.run, draft, audiences) for draft in item.drafts]
            if members:
                values = [
                    {"audience_id": audience, "member_id": member} for audience, member in sorted(members)
                ]
                await conn.execute(self._upsert(audience_members).values(values).on_conflict_do_nothing())
            if rows:
                await conn.execute(segments.insert(), rows)
                archived = sa.select(segments.c.id, segments.c.agent_id, segments.c.workspace_id).where(
                    segments.c.run_id.in_(sorted(written))
                )
                await conn.execute(
                    sa.insert(unembedded).from_select(["segment_id", "agent_id", "workspace_id"], archived)
                )
                if self._db.is_sqlite:
                    await conn.execute(
                        sa.insert(search.segment_fts).from_select(
                            ["rowid", "terms"],
                            sa.select(segments.c.id, segments.c.terms).where(
                                segments.c.run_id.in_(sorted(written))
                            ),
                        )
                    )
            await self._bump(
                conn, scopes_of((item.run.agent_id, item.run.workspace_id) for item in written.values())
            )
        self.term_frequencies.forget_absent()
        return outcomes, again

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
        }

    async def _delete_segments(self, conn: AsyncConnection, where: sa.ColumnElement[bool]) -> int:
        if not self._db.is_sqlite:
            # Rows locked in key order, as the embedder locks them: a delete and
            # a vector being stored for the same rows then wait, never deadlock.
            locked = (
                sa.select(segments.c.id).where(where).order_by(segments.c.id).with_for_update().subquery()
            )
            await conn.execute(sa.select(sa.func.count()).select_from(locked))
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
            await self._bump(conn, scopes_of((row.agent_id, row.workspace_id) for row in affected))
        return deleted

    async def store_embeddings(
        self, pending: Sequence[PendingSegment], vectors: npt.NDArray[np.float32]
    ) -> int:
        if len(pending) != len(vectors):
            raise ValueError("one vector per pending segment")
        by_key = {
            item.key: np.asarray(vector, dtype="<f4") for item, vector in zip(pending, vectors, strict=True)
        }
        if not by_key:
            return 0
        async with self._db.transaction() as conn:
            # The rows still without a vector, locked on PostgreSQL: a replica
            # embedding the same rows at once waits here and then finds them done.
            query = (
                sa.select(
                    unembedded.c.segment_id.label("id"),
                    segments.c.language,
                    unembedded.c.agent_id,
                    unembedded.c.workspace_id,
                )
                .join(segments, segments.c.id == unembedded.c.segment_id)
                .where(unembedded.c.segment_id.in_(sorted(by_key)))
            )
            if not self._db.is_sqlite:
                # The segments first, in key order (as a delete locks them), then their queue rows.
                await conn.execute(
                    sa.select(segments.c.id)
                    .where(segments.c.id.in_(sorted(by_key)))
                    .order_by(segments.c.id)
                    .with_for_update(key_share=True)
                )
                query = query.order_by(unembedded.c.segment_id).with_for_update(of=unembedded)
            waiting = (await conn.execute(query)).all()
            if not waiting:
                return 0
            done = sorted(row.id for row in waiting)
            await conn.execute(unembedded.delete().where(unembedded.c.segment_id.in_(done)))
            added: dict[str, list[npt.NDArray[np.float32]]] = {}
            for row in waiting:
                added.setdefault(row.language, []).append(by_key[row.id])
            epoch_started = False
            if self.pgvector is None:
                await conn.execute(
                    segment_vectors.insert(),
                    [{"segment_id": row.id, "embedding": by_key[row.id].tobytes()} for row in waiting],
                )
                await self._add_to_means(conn, added)
            else:
                # The centered copies need the languages' new means.
                means = await self._add_to_means(conn, added)
                epoch_started = await self.pgvector.centering.insert(
                    conn, [(row.id, row.language, by_key[row.id]) for row in waiting], means
                )
            await self._bump(conn, scopes_of((row.agent_id, row.workspace_id) for row in waiting))
        if epoch_started and self.pgvector is not None:
            self.pgvector.centering.wake()
        return len(waiting)

    async def _add_to_means(
        self, conn: AsyncConnection, vectors: dict[str, list[npt.NDArray[np.float32]]]
    ) -> LanguageMeans:
        """Adds vectors (by language) to the running sums the languages' means
        come from; returns those languages' means as they are now."""
        sums = {language: np.sum(rows, axis=0, dtype=np.float64) for language, rows in vectors.items()}
        counts = {language: len(rows) for language, rows in vectors.items()}
        query = sa.select(language_means).where(language_means.c.language.in_(sorted(sums)))
        if not self._db.is_sqlite:
            query = query.with_for_update()
        stored = {row.language: row for row in (await conn.execute(query)).all()}
        now: dict[str, tuple[int, list[float]]] = {}
        for language, added in sums.items():
            row = stored.get(language)
            if row is None:
                await conn.execute(
                    language_means.insert().values(
                        language=language, count=counts[language], sums=added.astype("<f8").tobytes()
                    )
                )
                now[language] = (counts[language], added.astype("<f8").tolist())
                continue
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
            now[language] = (count, total.astype("<f8").tolist())
        return LanguageMeans.restored(self.dimensions, now)

    # -- reading ------------------------------------------------------------

    async def _read(self, statement: sa.Executable) -> Any:
        async def read() -> Any:
            async with self._db.transaction(write=False) as conn:
                return (await conn.execute(statement)).all()

        return await self._db.retry_read(read)

    async def agent_identity(self, agent_id: str) -> AgentIdentity | None:
        # An agent's workspace and member id never change: once seen, kept.
        known = self._identities.get(agent_id)
        if known is not None:
            self._identities.move_to_end(agent_id)
            return known
        rows = await self._read(
            sa.select(runs.c.workspace_id, runs.c.agent_member_id).where(runs.c.agent_id == agent_id).limit(1)
        )
        if not rows:
            return None
        found = self._identities[agent_id] = AgentIdentity(rows[0].workspace_id, rows[0].agent_member_id)
        while len(self._identities) > _KNOWN_AGENTS:
            self._identities.popitem(last=False)
        return found

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
        rows = await self._read(
            sa.select(*_SEGMENT_COLUMNS, segments.c.terms).where(segments.c.id.in_(sorted(set(keys))))
        )
        return {int(row.id): _segment(row, row.terms) for row in rows}

    async def lexical_search(
        self, scope: Scope, filters: Filters, terms: Sequence[str], limit: int
    ) -> list[Hit]:
        return (await self.lexical_search_each(scope, filters, [terms], limit))[0]

    async def lexical_search_each(
        self, scope: Scope, filters: Filters, term_lists: Sequence[Sequence[str]], limit: int
    ) -> list[list[Hit]]:
        # One transaction, and the terms of every list counted in one statement.
        async def read() -> list[list[Hit]]:
            async with self._db.transaction(write=False) as conn:
                every = [term for terms in term_lists for term in terms]
                total, frequencies = await self.term_frequencies.counts(conn, every, analyze=self._analyze)
                found: list[list[Hit]] = []
                for terms in term_lists:
                    kept = selective_terms({t: frequencies[t] for t in terms}, self._lexical_postings)
                    if not kept:
                        found.append([])
                    elif self._db.is_sqlite:
                        found.append(await search.lexical_sqlite(conn, scope, filters, kept, limit))
                    else:
                        found.append(
                            await search.lexical_postgres(
                                conn, scope, filters, kept, limit, total=total, frequencies=frequencies
                            )
                        )
                return found

        return await self._db.retry_read(read)

    async def _analyze(self) -> None:
        async with self._db.transaction() as conn:
            await conn.execute(sa.text(f"ANALYZE {SCHEMA}.segments"))
        logger.info("analyzed the memory's segments (their terms' statistics rank lexical search)")

    async def term_rarity(self, terms: Sequence[str]) -> dict[str, float]:
        async def read() -> tuple[int, dict[str, int]]:
            async with self._db.transaction(write=False) as conn:
                return await self.term_frequencies.counts(conn, terms, analyze=self._analyze)

        # Right after a lexical search of the same terms, their counts are at hand.
        cached = self.term_frequencies.cached(terms)
        total, frequencies = cached if cached is not None else await self._db.retry_read(read)
        return {term: rarity(total, frequencies[term]) for term in dict.fromkeys(terms)}

    async def vector_search(
        self, scope: Scope, filters: Filters, query: Vector, language: str, limit: int
    ) -> list[Hit]:
        if self.pgvector is not None and self.pgvector.ready:
            return await self.pgvector.search(scope, filters, query, language, limit)

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
        where: list[sa.ColumnElement[bool]] = []
        if scope is not None:
            where.append(unembedded.c.workspace_id == scope.workspace_id)
            if scope.agent_id is not None:
                where.append(unembedded.c.agent_id == scope.agent_id)
        rows = await self._read(sa.select(sa.func.count()).select_from(unembedded).where(*where))
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

    async def target_agents(self, target: ForgetTarget) -> set[str]:
        where = [
            runs.c[name] == getattr(target, name)
            for name in ("run_id", "session_id", "agent_id", "workspace_id")
            if getattr(target, name)
        ]
        if not where:
            return set()
        rows = await self._read(sa.select(runs.c.agent_id).where(*where).distinct())
        return {row.agent_id for row in rows}

    async def stats(self, *, agent_id: str = "", workspace_id: str = "") -> MemoryStats:
        run_where = runs.c.agent_id == agent_id if agent_id else runs.c.workspace_id == workspace_id
        segment_where = (
            segments.c.agent_id == agent_id if agent_id else segments.c.workspace_id == workspace_id
        )
        run_count = sa.select(sa.func.count()).select_from(runs).where(run_where).scalar_subquery()
        pending_where = (
            unembedded.c.agent_id == agent_id if agent_id else unembedded.c.workspace_id == workspace_id
        )
        pending_count = (
            sa.select(sa.func.count()).select_from(unembedded).where(pending_where).scalar_subquery()
        )
        rows = await self._read(
            sa.select(
                run_count.label("runs"),
                sa.func.count().label("segments"),
                pending_count.label("pending"),
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
            .join(unembedded, unembedded.c.segment_id == segments.c.id)
            .order_by(unembedded.c.segment_id)
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
