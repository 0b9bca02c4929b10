"""Finding segments: the audience rule and filters as SQL, lexical search on
each backend, and exact vector search over a cached per-scope matrix.

Lexical search runs on terms that `domain.terms` made (CJK bigrams, lower-case
words, identifiers whole and in parts). On SQLite, FTS5 ranks them with
`bm25()`. On PostgreSQL a GIN index over the same terms finds the candidates;
query terms found in very many segments are dropped first (they cost most and
say least), and the candidates get a BM25 score here.

Vectors are searched exactly in numpy: each replica keeps the matrix of an
agent's (or a workspace's) embedded segments, already centered per language,
and reloads it when the scope's version (bumped by every write) moves on, one
cheap query per search.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.memory.adapters.tables import audience_members, language_means, scope_versions, segments
from services.memory.domain.ranking import Hit, LanguageMeans
from services.memory.domain.scope import Filters, Scope

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


# Counting a term's segments stops here: past it a term is common, and its
# exact count no longer changes its (small) weight much.
RARITY_CAP = 5000


def idf(total: int, frequency: int) -> float:
    """FTS5's idf, never negative."""
    return math.log(1 + (max(total, 1) - frequency + 0.5) / (frequency + 0.5))


async def term_rarity_sqlite(conn: AsyncConnection, terms: Sequence[str]) -> dict[str, float]:
    distinct = list(dict.fromkeys(terms))
    if not distinct:
        return {}
    counts = ", ".join(
        f"(SELECT count(*) FROM (SELECT 1 FROM segment_fts WHERE segment_fts MATCH :q{index} LIMIT :cap))"
        for index in range(len(distinct))
    )
    binds: dict[str, object] = {f"q{i}": '"' + t.replace('"', '""') + '"' for i, t in enumerate(distinct)}
    row = (
        await conn.execute(
            sa.text(f"SELECT (SELECT count(*) FROM segment_fts), {counts}"), {**binds, "cap": RARITY_CAP}
        )
    ).one()
    return {term: idf(int(row[0]), int(row[i + 1])) for i, term in enumerate(distinct)}


async def term_rarity_postgres(conn: AsyncConnection, terms: Sequence[str]) -> dict[str, float]:
    distinct = list(dict.fromkeys(terms))
    if not distinct:
        return {}
    total, frequencies = await _frequencies_postgres(conn, distinct, RARITY_CAP)
    return {term: idf(total, frequencies[term]) for term in distinct}


async def _frequencies_postgres(
    conn: AsyncConnection, distinct: Sequence[str], cap: int
) -> tuple[int, dict[str, int]]:
    """The table's size (the planner's estimate) and each term's segments,
    counted no further than `cap` (a GIN lookup each): one round trip."""
    counts = ", ".join(
        f"(SELECT count(*) FROM (SELECT 1 FROM memory.segments WHERE tsv @@ CAST(:q{index} AS tsquery)"
        f" LIMIT :cap) AS found{index})"
        for index in range(len(distinct))
    )
    binds: dict[str, object] = {f"q{index}": _tsquery([term]) for index, term in enumerate(distinct)}
    size = "(SELECT reltuples FROM pg_class WHERE oid = 'memory.segments'::regclass)"
    row = (await conn.execute(sa.text(f"SELECT {size}, {counts}"), {**binds, "cap": cap})).one()
    frequencies = {term: int(row[index + 1]) for index, term in enumerate(distinct)}
    return max(int(row[0] or 0), *frequencies.values()), frequencies


def _tsquery(terms: Sequence[str]) -> str:
    return " | ".join("'" + term.replace("\\", "\\\\").replace("'", "''") + "'" for term in terms)


async def lexical_postgres(
    conn: AsyncConnection,
    scope: Scope,
    filters: Filters,
    terms: Sequence[str],
    limit: int,
    *,
    common_term_docs: int,
) -> list[Hit]:
    distinct = list(dict.fromkeys(terms))
    if not distinct:
        return []
    # Document frequencies, counted no further than "common" (a common term
    # costs only up to the cap), enough for idf.
    total, frequencies = await _frequencies_postgres(conn, distinct, common_term_docs + 1)
    kept = [term for term in distinct if 0 < frequencies[term] <= common_term_docs]
    if not kept:
        # All common: the rarest still says something.
        present = [term for term in distinct if frequencies[term] > 0]
        if not present:
            return []
        kept = [min(present, key=lambda term: frequencies[term])]
    statement = (
        sa.select(segments.c.id, segments.c.terms, segments.c.term_count)
        .where(sa.text("tsv @@ CAST(:lexical_query AS tsquery)"), *conditions(scope, filters))
        .order_by(sa.text("ts_rank(tsv, CAST(:lexical_query AS tsquery)) DESC"))
        .limit(limit * 4)
        .params(lexical_query=_tsquery(kept))
    )
    rows = (await conn.execute(statement)).all()
    if not rows:
        return []
    average_length = max(1.0, sum(row.term_count for row in rows) / len(rows))
    weights = {term: idf(total, frequencies[term]) for term in kept}
    hits: list[Hit] = []
    for row in rows:
        tf = Counter(row.terms.split(" "))
        norm = _BM25_K1 * (1 - _BM25_B + _BM25_B * row.term_count / average_length)
        score = sum(weights[t] * tf[t] * (_BM25_K1 + 1) / (tf[t] + norm) for t in kept if tf[t])
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


# A cached matrix smaller than this is loaded whole on any change.
_APPEND_FROM_ROWS = 64


@dataclass
class _ScopeMatrix:
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


class VectorIndex:
    """Exact vector search over cached per-scope matrices (agents and workspaces).

    Args:
        dimensions: the embedder's vector size (rows of another size are skipped).
        max_scopes: matrices kept at once; the least recently used goes first.
    """

    def __init__(self, dimensions: int, *, max_scopes: int = 64) -> None:
        self.dimensions = dimensions
        self._max_scopes = max_scopes
        self._cache: OrderedDict[str, _ScopeMatrix] = OrderedDict()
        self.loads = 0
        self.appends = 0

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
        candidates = np.flatnonzero(mask)
        if not len(candidates):
            return []
        centered = entry.means.center(query.astype(np.float32), language)
        scores = entry.matrix[candidates] @ centered
        top = min(limit, len(candidates))
        best = np.argpartition(-scores, top - 1)[:top]
        best = best[np.argsort(-scores[best], kind="stable")]
        return [Hit(int(entry.keys[candidates[i]]), float(scores[i])) for i in best]

    async def _visible_audiences(self, conn: AsyncConnection, members: frozenset[str]) -> list[str]:
        return [str(value) for value in (await conn.execute(visible_audiences(members))).scalars()]

    async def _matrix(self, conn: AsyncConnection, scope: Scope) -> _ScopeMatrix:
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
        return entry

    @staticmethod
    def _where(scope: Scope) -> list[sa.ColumnElement[bool]]:
        where = [segments.c.workspace_id == scope.workspace_id, segments.c.embedding.is_not(None)]
        if scope.agent_id is not None:
            where.append(segments.c.agent_id == scope.agent_id)
        return where

    async def _appended(
        self, conn: AsyncConnection, scope: Scope, entry: _ScopeMatrix, version: int
    ) -> _ScopeMatrix | None:
        """The cached matrix with the rows embedded since, when nothing else
        changed (no row of it gone or replaced, none embedded out of order);
        None when it must be loaded whole."""
        if len(entry.keys) < _APPEND_FROM_ROWS or len(entry.keys) >= 2 * entry.loaded_rows:
            return None  # small (a reload costs nothing) or grown past its centering
        last = int(entry.keys.max()) if len(entry.keys) else 0
        where = self._where(scope)
        before = await conn.execute(sa.select(sa.func.count()).where(*where, segments.c.id <= last))
        if int(before.scalar_one()) != len(entry.keys):
            return None
        rows = await self._rows(conn, [*where, segments.c.id > last])
        self.appends += 1
        added = self._build(rows, entry.means, version, entry.loaded_rows)
        return _ScopeMatrix(
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
        )

    async def _rows(self, conn: AsyncConnection, where: Sequence[sa.ColumnElement[bool]]) -> list[Any]:
        statement = sa.select(
            segments.c.id,
            segments.c.embedding,
            segments.c.language,
            segments.c.type,
            segments.c.created_at,
            segments.c.group_id,
            segments.c.audience_id,
            segments.c.run_id,
            segments.c.agent_id,
        ).where(*where)
        size = self.dimensions * 4
        return [row for row in (await conn.execute(statement)).all() if len(row.embedding) == size]

    async def _load(self, conn: AsyncConnection, scope: Scope, version: int) -> _ScopeMatrix:
        self.loads += 1
        rows = await self._rows(conn, self._where(scope))
        means = await load_means(conn, self.dimensions)
        return self._build(rows, means, version, len(rows))

    def _build(
        self, rows: Sequence[Any], means: LanguageMeans, version: int, loaded_rows: int
    ) -> _ScopeMatrix:
        matrix = np.frombuffer(b"".join(row.embedding for row in rows), dtype="<f4").reshape(
            len(rows), self.dimensions
        )
        matrix = matrix.astype(np.float32, copy=True)
        languages = np.asarray([row.language for row in rows], dtype=object)
        for language in set(languages.tolist()):
            matrix[languages == language] -= means.mean(language)
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        matrix /= np.where(norms > 0, norms, 1.0)
        return _ScopeMatrix(
            version=version,
            loaded_rows=loaded_rows,
            keys=np.asarray([row.id for row in rows], dtype=np.int64),
            matrix=matrix,
            means=means,
            types=np.asarray([row.type for row in rows], dtype=np.int16),
            times=np.asarray([row.created_at.timestamp() for row in rows], dtype=np.float64),
            groups=_Codes([row.group_id for row in rows]),
            audiences=_Codes([row.audience_id for row in rows]),
            run_ids=_Codes([row.run_id for row in rows]),
            agents=_Codes([row.agent_id for row in rows]),
        )
