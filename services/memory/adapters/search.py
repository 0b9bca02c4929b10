"""Finding segments: the audience rule and filters as SQL, lexical search on
each backend, and exact vector search over a cached per-scope matrix.

Lexical search runs on terms that `domain.terms` made (CJK bigrams, lower-case
words, identifiers whole and in parts). Query terms found in very many
segments are dropped first (they cost most and say least: see
`selective_terms`). On SQLite, FTS5 ranks the segments holding the rest with
`bm25()`; on PostgreSQL a GIN index over the same terms finds them, and they
get a BM25 score here.

Vectors are searched exactly in numpy: each replica keeps the matrix of an
agent's (or a workspace's) embedded segments, already centered per language,
and reloads it when the scope's version (bumped by every write) moves on, one
cheap query per search.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.memory.adapters.clusters import Clusters, Stopped, cluster
from services.memory.adapters.tables import (
    audience_members,
    language_means,
    scope_versions,
    segment_vectors,
    segments,
)
from services.memory.domain.ranking import Hit, LanguageMeans, idf
from services.memory.domain.scope import Filters, Scope

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The FTS5 table of the SQLite backend (see the first migration).
segment_fts = sa.table("segment_fts", sa.column("rowid", sa.Integer), sa.column("terms", sa.Text))
_BM25_K1 = 1.2
_BM25_B = 0.75


def visible_audiences(members: frozenset[str]) -> sa.Select[tuple[str]]:
    """Audiences that include every one of `members` (members ⊆ audience)."""
    return (
        sa.select(audience_members.c.audience_id)
        .where(audience_members.c.member_id.in_(sorted(members)))
        .group_by(audience_members.c.audience_id)
        .having(sa.func.count(sa.distinct(audience_members.c.member_id)) == len(members))
    )


def visibility(scope: Scope) -> sa.ColumnElement[bool] | None:
    """The audience rule (see `domain.audience`) as a condition on segments."""
    if scope.agent_scope:
        if not scope.audience:
            return None
        return sa.or_(
            segments.c.audience_id == "", segments.c.audience_id.in_(visible_audiences(scope.audience))
        )
    return segments.c.audience_id.in_(visible_audiences(scope.audience))


def conditions(scope: Scope, filters: Filters) -> list[sa.ColumnElement[bool]]:
    """Scope, audience rule and filters, as conditions on segments."""
    where: list[sa.ColumnElement[bool]] = [segments.c.workspace_id == scope.workspace_id]
    if scope.agent_id is not None:
        where.append(segments.c.agent_id == scope.agent_id)
    rule = visibility(scope)
    if rule is not None:
        where.append(rule)
    if filters.types:
        where.append(segments.c.type.in_(sorted(int(t) for t in filters.types)))
    if filters.since is not None:
        where.append(segments.c.created_at >= filters.since)
    if filters.until is not None:
        where.append(segments.c.created_at < filters.until)
    if filters.group_id:
        where.append(segments.c.group_id == filters.group_id)
    if filters.agent_id:
        where.append(segments.c.agent_id == filters.agent_id)
    if filters.exclude_run_ids:
        where.append(segments.c.run_id.not_in(sorted(filters.exclude_run_ids)))
    return where


class TermFrequencies:
    """How many segments hold each term, as each backend can tell it cheaply,
    kept for a while: lexical search and the fusion gate both need a query's
    document frequencies, and the common terms come up in query after query.

    A term's segments are counted in the lexical index, no further than
    `cap` (a common term costs no more than that). PostgreSQL must visit the
    rows to count, so there the common terms come from the planner's
    statistics of the `tsv` column instead (`pg_stats.most_common_elems`:
    the terms in more than about 0.2% of segments, with their frequencies),
    and only the others are counted, each up to that threshold. The service
    runs ANALYZE itself when those statistics are missing or the table has
    grown by a fifth since (autovacuum, where it is on, does too).

    A term found nowhere is kept apart, and not for long: the segments that
    hold it may be archived the next moment, and until they are counted
    lexical search leaves the term out. The store forgets those when it
    archives; another replica's archives are seen after `absent_ttl_seconds`.

    Args:
        cap: counting stops here.
        ttl_seconds: how long a count (or the statistics) is used before it
            is read again.
        absent_ttl_seconds: the same for a term found in no segment.
        max_terms: counts kept at once; the oldest go first.
    """

    def __init__(
        self,
        *,
        cap: int,
        sqlite: bool,
        ttl_seconds: float = 60.0,
        absent_ttl_seconds: float = 1.0,
        max_terms: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap = cap
        self._sqlite = sqlite
        self._ttl = ttl_seconds
        self._absent_ttl = absent_ttl_seconds
        self._max_terms = max_terms
        self._clock = clock
        self._counts: OrderedDict[str, tuple[float, int]] = OrderedDict()
        # Terms found in no segment, and when.
        self._absent: dict[str, float] = {}
        self._total: tuple[float, int] | None = None
        self._statistics: tuple[float, _PlannerStatistics] | None = None
        self._analysis: asyncio.Task[None] | None = None
        self.lookups = 0
        self.analyses = 0

    def cached(self, terms: Sequence[str]) -> tuple[int, dict[str, int]] | None:
        """What `counts` would answer, if it needs no database: every count
        (and the statistics on PostgreSQL) read within the last `ttl_seconds`."""
        statistics = self._fresh(self._statistics)
        if not self._sqlite and statistics is None:
            return None
        total = statistics.total if statistics is not None else self._fresh(self._total)
        known, missing = self._known(terms, statistics)
        if missing or total is None:
            return None
        return max(total, *known.values(), 0), known

    async def counts(
        self,
        conn: AsyncConnection,
        terms: Sequence[str],
        *,
        analyze: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[int, dict[str, int]]:
        """The number of segments and each term's count (at most `cap`;
        estimated for PostgreSQL's common terms). `analyze` refreshes
        PostgreSQL's statistics when they are missing or stale."""
        statistics = None if self._sqlite else await self._planner_statistics(conn, analyze)
        total = statistics.total if statistics is not None else self._fresh(self._total)
        known, missing = self._known(terms, statistics)
        if missing or total is None:
            self.lookups += 1
            cap = self.cap if statistics is None else int(min(self.cap, statistics.rare_ceiling))
            counted_total, counted = await _count_terms(conn, missing, cap)
            now = self._clock()
            if total is None:
                total = counted_total
                self._total = (now, total)
            for term, count in counted.items():
                if count == 0:
                    self._absent[term] = now
                    continue
                self._absent.pop(term, None)
                self._counts[term] = (now, count)
                self._counts.move_to_end(term)
            while len(self._counts) > self._max_terms:
                self._counts.popitem(last=False)
            if len(self._absent) > self._max_terms:
                self._absent = {}
            known.update(counted)
        return max(total, *known.values(), 0), known

    def forget_absent(self) -> None:
        """Segments were archived: a term found nowhere before may be in them."""
        self._absent = {}

    def _fresh(self, stamped: tuple[float, T] | None) -> T | None:
        if stamped is None or self._clock() - stamped[0] >= self._ttl:
            return None
        return stamped[1]

    def _fresh_count(self, term: str) -> int | None:
        absent_since = self._absent.get(term)
        if absent_since is not None and self._clock() - absent_since < self._absent_ttl:
            return 0
        return self._fresh(self._counts.get(term))

    def _known(
        self, terms: Sequence[str], statistics: _PlannerStatistics | None
    ) -> tuple[dict[str, int], list[str]]:
        """The counts at hand (the statistics' common terms, fresh counts) and the terms left to count."""
        known: dict[str, int] = {}
        missing: list[str] = []
        for term in dict.fromkeys(terms):
            if statistics is not None and term in statistics.common:
                known[term] = statistics.common[term]
            elif (count := self._fresh_count(term)) is not None:
                known[term] = count
            else:
                missing.append(term)
        return known, missing

    async def _planner_statistics(
        self, conn: AsyncConnection, analyze: Callable[[], Awaitable[None]] | None
    ) -> _PlannerStatistics:
        fresh = self._fresh(self._statistics)
        if fresh is not None:
            return fresh
        statistics = await _read_planner_statistics(conn)
        self._statistics = (self._clock(), statistics)
        if analyze is not None and statistics.stale and (self._analysis is None or self._analysis.done()):
            self._analysis = asyncio.create_task(self._analyze(analyze), name="memory-analyze")
        return statistics

    async def _analyze(self, analyze: Callable[[], Awaitable[None]]) -> None:
        try:
            await analyze()
        except Exception as error:  # the statistics only make search cheaper
            logger.warning("ANALYZE of the memory's segments failed: %s", error)
            return
        self.analyses += 1
        self._statistics = None

    async def analysis_done(self) -> None:
        """Returns when no ANALYZE started here is running (for tests)."""
        if self._analysis is not None:
            await asyncio.shield(self._analysis)

    async def aclose(self) -> None:
        task, self._analysis = self._analysis, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass(frozen=True, slots=True)
class _PlannerStatistics:
    total: int
    # The common terms and their estimated counts.
    common: dict[str, int]
    # Any other term is in fewer segments than this (the cap for counting it).
    rare_ceiling: float
    # Whether ANALYZE is due: never run, or the table grew by a fifth since
    # (counted from 1,000 rows: a small table costs nothing to search).
    stale: bool


async def _read_planner_statistics(conn: AsyncConnection) -> _PlannerStatistics:
    row = (
        await conn.execute(
            sa.text(
                "SELECT c.reltuples, s.n_live_tup, st.most_common_elems::text::text[] AS elements,"
                " st.most_common_elem_freqs AS frequencies"
                " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
                " LEFT JOIN pg_stats st"
                "   ON st.schemaname = 'memory' AND st.tablename = 'segments' AND st.attname = 'tsv'"
                " WHERE c.oid = 'memory.segments'::regclass"
            )
        )
    ).one()
    analyzed = float(row.reltuples)  # -1: never analyzed
    live = int(row.n_live_tup or 0)
    total = max(int(analyzed), live, 0)
    stale = analyzed < 0 or live > 1.2 * max(analyzed, 1000.0)
    elements, frequencies = row.elements, row.frequencies
    if not elements or not frequencies:
        # No statistics yet: every term is counted (up to the cap).
        return _PlannerStatistics(total, {}, math.inf, stale)
    # The frequencies end with their minimum and maximum (see pg_stats).
    common = {term: max(1, round(freq * total)) for term, freq in zip(elements, frequencies, strict=False)}
    ceiling = max(1, round(float(frequencies[len(elements)]) * total))
    return _PlannerStatistics(total, common, ceiling, stale)


async def _count_terms(conn: AsyncConnection, terms: Sequence[str], cap: int) -> tuple[int, dict[str, int]]:
    """The number of segments (on SQLite; PostgreSQL's comes with its
    statistics) and each term's segments, no further than `cap`: one statement."""
    if conn.dialect.name == "sqlite":
        size = "(SELECT max(id) FROM segments)"
        count = "(SELECT count(*) FROM (SELECT 1 FROM segment_fts WHERE segment_fts MATCH :q{i} LIMIT :cap))"
        binds: dict[str, object] = {f"q{i}": '"' + t.replace('"', '""') + '"' for i, t in enumerate(terms)}
    else:
        size = "0"
        count = (
            "(SELECT count(*) FROM (SELECT 1 FROM memory.segments WHERE tsv @@ CAST(:q{i} AS tsquery)"
            " LIMIT :cap) AS found{i})"
        )
        binds = {f"q{i}": _tsquery([term]) for i, term in enumerate(terms)}
    counts = "".join(", " + count.format(i=i) for i in range(len(terms)))
    row = (await conn.execute(sa.text(f"SELECT {size}{counts}"), {**binds, "cap": cap})).one()
    return max(0, int(row[0] or 0)), {term: int(row[i + 1]) for i, term in enumerate(terms)}


async def lexical_sqlite(
    conn: AsyncConnection, scope: Scope, filters: Filters, terms: Sequence[str], limit: int
) -> list[Hit]:
    # Every term quoted: FTS5 then reads it as one token, never as syntax.
    match = " OR ".join('"' + term.replace('"', '""') + '"' for term in dict.fromkeys(terms))
    if not match:
        return []
    rank: sa.ColumnElement[float] = sa.literal_column("bm25(segment_fts)")
    statement = (
        sa.select(segments.c.id, rank.label("rank"))
        .select_from(segments.join(segment_fts, segment_fts.c.rowid == segments.c.id))
        .where(sa.text("segment_fts MATCH :match").bindparams(match=match), *conditions(scope, filters))
        .order_by(rank)
        .limit(limit)
    )
    rows = (await conn.execute(statement)).all()
    # bm25() is lower for better matches.
    return [Hit(int(row.id), -float(row.rank)) for row in rows]


def _tsquery(terms: Sequence[str]) -> str:
    return " | ".join("'" + term.replace("\\", "\\\\").replace("'", "''") + "'" for term in terms)


async def lexical_postgres(
    conn: AsyncConnection,
    scope: Scope,
    filters: Filters,
    terms: Sequence[str],
    limit: int,
    *,
    total: int,
    frequencies: dict[str, int],
) -> list[Hit]:
    """Segments matching any of `terms` (the GIN index finds them), scored
    here with BM25 (each term's idf from `frequencies`)."""
    if not terms:
        return []
    statement = (
        sa.select(segments.c.id, segments.c.terms, segments.c.term_count)
        .where(sa.text("tsv @@ CAST(:lexical_query AS tsquery)"), *conditions(scope, filters))
        .order_by(sa.text("ts_rank(tsv, CAST(:lexical_query AS tsquery)) DESC"))
        .limit(limit * 4)
        .params(lexical_query=_tsquery(terms))
    )
    rows = (await conn.execute(statement)).all()
    if not rows:
        return []
    average_length = max(1.0, sum(row.term_count for row in rows) / len(rows))
    weights = {term: idf(total, frequencies.get(term, 0)) for term in terms}
    hits: list[Hit] = []
    for row in rows:
        tf = Counter(row.terms.split(" "))
        norm = _BM25_K1 * (1 - _BM25_B + _BM25_B * row.term_count / average_length)
        score = sum(weights[t] * tf[t] * (_BM25_K1 + 1) / (tf[t] + norm) for t in terms if tf[t])
        hits.append(Hit(int(row.id), score))
    hits.sort(key=lambda hit: (-hit.score, hit.key))
    return hits[:limit]


async def scope_version(conn: AsyncConnection, key: str) -> int:
    found = await conn.execute(sa.select(scope_versions.c.version).where(scope_versions.c.scope == key))
    return int(found.scalar_one_or_none() or 0)


async def load_means(conn: AsyncConnection, dimensions: int) -> LanguageMeans:
    rows = (await conn.execute(sa.select(language_means))).all()
    state = {
        row.language: (int(row._mapping["count"]), np.frombuffer(row.sums, dtype="<f8").tolist())
        for row in rows
    }
    return LanguageMeans.restored(dimensions, {k: v for k, v in state.items() if len(v[1]) == dimensions})


class _Codes:
    """Small integer codes for the strings of one column, for fast masks."""

    def __init__(self, values: Sequence[str]) -> None:
        self.index: dict[str, int] = {}
        self.array = np.fromiter(
            (self.index.setdefault(v, len(self.index)) for v in values), np.int32, len(values)
        )

    def mask(self, wanted: Sequence[str]) -> npt.NDArray[np.bool_]:
        codes = [self.index[v] for v in wanted if v in self.index]
        return np.isin(self.array, np.asarray(codes, dtype=np.int32))

    def extended(self, values: Sequence[str]) -> _Codes:
        """These codes followed by those of `values` (the index grows as needed)."""
        grown = _Codes([])
        grown.index = dict(self.index)
        more = np.fromiter(
            (grown.index.setdefault(v, len(grown.index)) for v in values), np.int32, len(values)
        )
        grown.array = np.concatenate([self.array, more])
        return grown

    def reordered(self, order: npt.NDArray[np.int64], tail: _Codes) -> _Codes:
        """The first len(order) codes in that order, then `tail`'s codes from there on."""
        moved = _Codes([])
        moved.index = tail.index
        moved.array = np.concatenate([self.array[order], tail.array[len(order) :]])
        return moved


# A cached matrix smaller than this is loaded whole on any change.
_APPEND_FROM_ROWS = 64


@dataclass
class ScopeMatrix:
    """The embedded segments of one scope, as a matrix and columns for filters."""

    version: int
    # Rows at the last full load: appending past twice as many reloads (the
    # language means the rows were centered with have moved on by then).
    loaded_rows: int
    keys: npt.NDArray[np.int64]
    # Rows centered per language and unit length again.
    matrix: npt.NDArray[np.float32]
    means: LanguageMeans
    types: npt.NDArray[np.int16]
    times: npt.NDArray[np.float64]
    groups: _Codes
    audiences: _Codes
    run_ids: _Codes
    agents: _Codes
    # Which full load these rows come from (appends keep it).
    load: int = 0
    # The approximate index over the first `clusters.rows` rows, once built.
    clusters: Clusters | None = None

    @classmethod
    def of_vectors(cls, matrix: npt.NDArray[np.float32]) -> ScopeMatrix:
        """A scope of `matrix`'s rows (keys 0 to n - 1, unit length, already
        centered) without filter columns: for measuring search alone."""
        rows = len(matrix)
        return cls(
            version=0,
            loaded_rows=rows,
            keys=np.arange(rows, dtype=np.int64),
            matrix=matrix,
            means=LanguageMeans(matrix.shape[1]),
            types=np.zeros(rows, dtype=np.int16),
            times=np.zeros(rows, dtype=np.float64),
            groups=_Codes([""] * rows),
            audiences=_Codes([""] * rows),
            run_ids=_Codes([""] * rows),
            agents=_Codes([""] * rows),
        )

    def reordered(self, order: npt.NDArray[np.int64], clusters: Clusters, tail: ScopeMatrix) -> ScopeMatrix:
        """These rows in `order` (ordered list by list for `clusters`), then the
        rows `tail` (this matrix grown since) has past them."""
        n = len(order)
        return ScopeMatrix(
            version=tail.version,
            loaded_rows=tail.loaded_rows,
            keys=np.concatenate([self.keys[order], tail.keys[n:]]),
            matrix=np.concatenate([self.matrix[order], tail.matrix[n:]]),
            means=tail.means,
            types=np.concatenate([self.types[order], tail.types[n:]]),
            times=np.concatenate([self.times[order], tail.times[n:]]),
            groups=self.groups.reordered(order, tail.groups),
            audiences=self.audiences.reordered(order, tail.audiences),
            run_ids=self.run_ids.reordered(order, tail.run_ids),
            agents=self.agents.reordered(order, tail.agents),
            load=tail.load,
            clusters=clusters,
        )


class VectorIndex:
    """Vector search over cached per-scope matrices (agents and workspaces):
    exact, and approximate (see `clusters`) for a scope of many rows once
    its index is built in the background.

    Args:
        dimensions: the embedder's vector size (rows of another size are skipped).
        max_scopes: matrices kept at once; the least recently used goes first.
        approximate_from_rows: a scope with at least this many rows gets an
            approximate index (0: never).
        probe_share: the share of the index's lists a search scores.
    """

    def __init__(
        self,
        dimensions: int,
        *,
        max_scopes: int = 64,
        approximate_from_rows: int = 200_000,
        probe_share: float = 1 / 40,
    ) -> None:
        self.dimensions = dimensions
        self._max_scopes = max_scopes
        self._approximate_from_rows = approximate_from_rows
        self._probe_share = probe_share
        self._cache: OrderedDict[str, ScopeMatrix] = OrderedDict()
        self._builds: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self.loads = 0
        self.appends = 0
        self.builds = 0
        self.approximate_searches = 0

    async def search(
        self,
        conn: AsyncConnection,
        scope: Scope,
        *,
        filters: Filters,
        query: npt.NDArray[np.float32],
        language: str,
        limit: int,
    ) -> list[Hit]:
        entry = await self._matrix(conn, scope)
        if not len(entry.keys):
            return []
        mask = np.ones(len(entry.keys), dtype=bool)
        if scope.agent_scope:
            if scope.audience:
                shown = await self._visible_audiences(conn, scope.audience)
                mask &= entry.audiences.mask([*shown, ""])
        else:
            mask &= entry.audiences.mask(await self._visible_audiences(conn, scope.audience))
        if filters.types:
            mask &= np.isin(entry.types, np.asarray(sorted(int(t) for t in filters.types), dtype=np.int16))
        if filters.since is not None:
            mask &= entry.times >= filters.since.astimezone(UTC).timestamp()
        if filters.until is not None:
            mask &= entry.times < filters.until.astimezone(UTC).timestamp()
        if filters.group_id:
            mask &= entry.groups.mask([filters.group_id])
        if filters.agent_id:
            mask &= entry.agents.mask([filters.agent_id])
        if filters.exclude_run_ids:
            mask &= ~entry.run_ids.mask(sorted(filters.exclude_run_ids))
        return self.rank(entry, mask, entry.means.center(query.astype(np.float32), language), limit)

    def rank(
        self, entry: ScopeMatrix, mask: npt.NDArray[np.bool_], centered: npt.NDArray[np.float32], limit: int
    ) -> list[Hit]:
        """The `limit` rows of `entry` allowed by `mask` nearest the (centered) query."""
        visible = int(mask.sum())
        if not visible:
            return []
        share = visible / len(mask)
        if entry.clusters is not None and share * share >= self._probe_share:
            hits = self._approximate(entry, entry.clusters, mask, centered, limit=limit, visible_share=share)
            if hits is not None:
                return hits
        # Few rows visible (filters): scoring just those costs less (a copy
        # of a third of the rows cost more than scoring them all).
        rows = np.flatnonzero(mask) if visible < len(mask) // 6 else None
        scores = entry.matrix @ centered if rows is None else entry.matrix[rows] @ centered
        if rows is None and visible < len(mask):
            scores = np.where(mask, scores, -np.inf)
        return _best(entry, scores, rows, min(limit, visible))

    def _approximate(
        self,
        entry: ScopeMatrix,
        clusters: Clusters,
        mask: npt.NDArray[np.bool_],
        query: npt.NDArray[np.float32],
        *,
        limit: int,
        visible_share: float,
    ) -> list[Hit] | None:
        """The best visible rows of the lists nearest the query, and of the
        rows added since the index was built; None if they hold too few."""
        rows = np.concatenate(
            [
                clusters.candidates(query, visible_share=visible_share),
                np.arange(clusters.rows, len(entry.keys), dtype=np.int64),
            ]
        )
        rows = rows[mask[rows]]
        if len(rows) < limit:
            return None
        self.approximate_searches += 1
        return _best(entry, entry.matrix[rows] @ query, rows, limit)

    async def _visible_audiences(self, conn: AsyncConnection, members: frozenset[str]) -> list[str]:
        return [str(value) for value in (await conn.execute(visible_audiences(members))).scalars()]

    async def _matrix(self, conn: AsyncConnection, scope: Scope) -> ScopeMatrix:
        key = scope.cache_key
        # Read before the rows: a write in between makes the next search reload.
        version = await scope_version(conn, key)
        entry = self._cache.get(key)
        if entry is not None and entry.version == version:
            self._cache.move_to_end(key)
            return entry
        grown = await self._appended(conn, scope, entry, version) if entry is not None else None
        entry = grown or await self._load(conn, scope, version)
        self._cache[key] = entry
        self._cache.move_to_end(key)
        while len(self._cache) > self._max_scopes:
            self._cache.popitem(last=False)
        self._maybe_build(key, entry)
        return entry

    def _maybe_build(self, key: str, entry: ScopeMatrix) -> None:
        """Starts building the scope's approximate index when it is big enough
        and has none, or has grown by a fifth since its index was built."""
        if not self._approximate_from_rows or len(entry.keys) < self._approximate_from_rows:
            return
        if entry.clusters is not None and len(entry.keys) < 1.2 * entry.clusters.rows:
            return
        running = self._builds.get(key)
        if (running is not None and not running.done()) or self._stopping:
            return
        self._builds[key] = asyncio.create_task(
            self._build_clusters(key, entry), name=f"memory-clusters-{key}"
        )

    async def _build_clusters(self, key: str, entry: ScopeMatrix) -> None:
        rows = len(entry.keys)
        try:
            clusters, order = await asyncio.to_thread(
                cluster, entry.matrix, probe_share=self._probe_share, should_stop=lambda: self._stopping
            )
        except Stopped:
            return
        except Exception:
            logger.exception("building the approximate index of %s failed; searching exactly", key)
            return
        current = self._cache.get(key)
        if current is None or current.load != entry.load or len(current.keys) < rows:
            return  # reloaded (rows were deleted or replaced) or gone: that one gets its own
        # Whatever changed while reordering (a second or two at a million rows)
        # is not lost: the result carries `current`'s version, so the next
        # search takes in the rows added since, or reloads after a deletion.
        self._cache[key] = await asyncio.to_thread(entry.reordered, order, clusters, current)
        self.builds += 1
        logger.info("%s: approximate index over %d rows in %d lists", key, rows, len(clusters.centroids))

    async def settled(self) -> None:
        """Returns once no approximate index is being built."""
        while running := [task for task in self._builds.values() if not task.done()]:
            await asyncio.wait(running)

    async def aclose(self) -> None:
        """Stops any index being built."""
        self._stopping = True
        builds, self._builds = list(self._builds.values()), {}
        for task in builds:
            with contextlib.suppress(Exception):
                await task

    @staticmethod
    def _where(scope: Scope) -> list[sa.ColumnElement[bool]]:
        where = [segments.c.workspace_id == scope.workspace_id]
        if scope.agent_id is not None:
            where.append(segments.c.agent_id == scope.agent_id)
        return where

    async def _appended(
        self, conn: AsyncConnection, scope: Scope, entry: ScopeMatrix, version: int
    ) -> ScopeMatrix | None:
        """The cached matrix with the rows embedded since, when nothing else
        changed (no row of it gone or replaced, none embedded out of order);
        None when it must be loaded whole."""
        if len(entry.keys) < _APPEND_FROM_ROWS or len(entry.keys) >= 2 * entry.loaded_rows:
            return None  # small (a reload costs nothing) or grown past its centering
        last = int(entry.keys.max()) if len(entry.keys) else 0
        where = self._where(scope)
        before = await conn.execute(
            sa.select(sa.func.count())
            .select_from(segments.join(segment_vectors, segment_vectors.c.segment_id == segments.c.id))
            .where(*where, segments.c.id <= last)
        )
        if int(before.scalar_one()) != len(entry.keys):
            return None
        rows = await self._rows(conn, [*where, segments.c.id > last])
        self.appends += 1
        added = self._build(rows, entry.means, version, entry.loaded_rows)
        return ScopeMatrix(
            version=version,
            loaded_rows=entry.loaded_rows,
            keys=np.concatenate([entry.keys, added.keys]),
            matrix=np.concatenate([entry.matrix, added.matrix]),
            means=entry.means,
            types=np.concatenate([entry.types, added.types]),
            times=np.concatenate([entry.times, added.times]),
            groups=entry.groups.extended([row.group_id for row in rows]),
            audiences=entry.audiences.extended([row.audience_id for row in rows]),
            run_ids=entry.run_ids.extended([row.run_id for row in rows]),
            agents=entry.agents.extended([row.agent_id for row in rows]),
            load=entry.load,
            clusters=entry.clusters,
        )

    async def _rows(self, conn: AsyncConnection, where: Sequence[sa.ColumnElement[bool]]) -> list[Any]:
        statement = (
            sa.select(
                segments.c.id,
                segment_vectors.c.embedding,
                segments.c.language,
                segments.c.type,
                segments.c.created_at,
                segments.c.group_id,
                segments.c.audience_id,
                segments.c.run_id,
                segments.c.agent_id,
            )
            .select_from(segments.join(segment_vectors, segment_vectors.c.segment_id == segments.c.id))
            .where(*where)
        )
        size = self.dimensions * 4
        return [row for row in (await conn.execute(statement)).all() if len(row.embedding) == size]

    async def _load(self, conn: AsyncConnection, scope: Scope, version: int) -> ScopeMatrix:
        self.loads += 1
        rows = await self._rows(conn, self._where(scope))
        means = await load_means(conn, self.dimensions)
        loaded = self._build(rows, means, version, len(rows))
        loaded.load = self.loads
        return loaded

    def _build(
        self, rows: Sequence[Any], means: LanguageMeans, version: int, loaded_rows: int
    ) -> ScopeMatrix:
        return ScopeMatrix(
            version=version,
            loaded_rows=loaded_rows,
            keys=np.asarray([row.id for row in rows], dtype=np.int64),
            matrix=centered_matrix(rows, means, self.dimensions),
            means=means,
            types=np.asarray([row.type for row in rows], dtype=np.int16),
            times=np.asarray([row.created_at.timestamp() for row in rows], dtype=np.float64),
            groups=_Codes([row.group_id for row in rows]),
            audiences=_Codes([row.audience_id for row in rows]),
            run_ids=_Codes([row.run_id for row in rows]),
            agents=_Codes([row.agent_id for row in rows]),
        )


def centered_matrix(rows: Sequence[Any], means: LanguageMeans, dimensions: int) -> npt.NDArray[np.float32]:
    """The rows' vectors (`row.embedding`, float32 bytes of `dimensions`; by
    `row.language`) centered per language and unit length again: what every
    vector search compares a centered query with."""
    matrix = np.frombuffer(b"".join(row.embedding for row in rows), dtype="<f4")
    matrix = matrix.reshape(len(rows), dimensions).astype(np.float32, copy=True)
    languages = np.asarray([row.language for row in rows], dtype=object)
    for language in set(languages.tolist()):
        matrix[languages == language] -= means.mean(language)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    matrix /= np.where(norms > 0, norms, 1.0)
    return matrix


def _best(
    entry: ScopeMatrix, scores: npt.NDArray[np.float32], rows: npt.NDArray[np.int64] | None, limit: int
) -> list[Hit]:
    """The `limit` best of `scores` (of `rows`, or of every row) as hits; of
    rows scored alike, those of lower keys (whatever order the rows are in)."""
    return best_hits(entry.keys, scores, rows, limit)


def best_hits(
    keys: npt.NDArray[np.int64],
    scores: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64] | None,
    limit: int,
) -> list[Hit]:
    """`_best` over any keys (those of `rows`, or all, in the order of `scores`)."""
    limit = min(limit, len(scores))
    if limit <= 0:
        return []
    threshold = np.partition(scores, len(scores) - limit)[len(scores) - limit]
    chosen = np.flatnonzero(scores >= threshold)
    positions = chosen if rows is None else rows[chosen]
    keys = keys[positions]
    ranked = np.lexsort((keys, -scores[chosen]))[:limit]
    return [Hit(int(keys[i]), float(scores[chosen[i]])) for i in ranked]
