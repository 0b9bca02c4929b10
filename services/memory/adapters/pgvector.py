"""Vector search inside PostgreSQL with pgvector: an HNSW index over the
segments' vectors, centered the way the ranking compares them.

The ranking compares vectors after centering per language
(`ranking.LanguageMeans`): a segment's vector minus the mean of the stored
vectors of its language, made unit length again, against the query centered
the same way. Those means move with every vector stored, and an index
cannot follow a distance that changes under it. So:

- `segment_vectors.centered` holds each vector centered with its language's
  mean *of the epoch it was written in* (`vector_centering`), and the HNSW
  index (inner product: the rows are unit length) is built over that
  column. A language starts a new epoch when its running mean has moved
  further than `recenter_drift` from the epoch's (often while a language
  has few vectors, seldom later); a background job then rewrites that
  language's rows, a few hundred per transaction.
- The index only picks candidates: twice as many as asked for, with the
  scope's audience rule and filters applied while the index is walked
  (pgvector 0.8's iterative scan, so that a narrow filter does not starve
  the result; when it still brings too few, the visible rows are searched
  exactly). Each candidate is then scored exactly as the numpy path scores
  it (its stored vector centered with the current means:
  `search.centered_matrix`), so both paths rank alike whenever the
  candidates hold numpy's best.
- None of this is in a migration: whether the extension exists, and the
  embedder's vector size, are known only when the service starts.
  `prepare` adds the column, its partial index of the rows still to center
  and the centering table when they are missing (idempotent, under an
  advisory lock). Vectors stored before (with pgvector off, or before it
  was installed) are centered by the same job, and the HNSW index is built
  after them, in one go and without blocking writes (CREATE INDEX
  CONCURRENTLY: at 100,000 rows several times faster than taking them in
  one by one); until then vector search stays on the numpy path.

Every replica of the service must agree on `MEMORY_PGVECTOR`: one with it
off stores vectors without their centered copies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from services.memory.adapters.centering import (
    Centering,
    IndexBeingBuilt,
    means_and_epochs,
    unit_rows,
    vector_centering,
    vectors_table,
)
from services.memory.adapters.search import best_hits, centered_matrix, conditions
from services.memory.adapters.tables import SCHEMA, segments
from services.memory.domain.ranking import Hit, LanguageMeans
from services.memory.domain.scope import Filters, Scope

if TYPE_CHECKING:
    from services.memory.adapters.sql import Database

logger = logging.getLogger(__name__)

Vector = npt.NDArray[np.float32]

# HNSW came with pgvector 0.5.0, iterative index scans with 0.8.0.
_HNSW_SINCE = (0, 5, 0)
_ITERATIVE_SINCE = (0, 8, 0)
# Advisory lock keys: `prepare` (two replicas starting at once), and the
# index build (held for its length by the replica that builds it).
_PREPARE_LOCK = 0x6D656D5F76656374
_BUILD_LOCK = 0x6D656D5F686E7377
HNSW_INDEX = "ix_memory_segment_vectors_centered"
UNCENTERED_INDEX = "ix_memory_segment_vectors_uncentered"
# maintenance_work_mem of the session that builds the HNSW index (pgvector
# builds much faster when its graph fits; see docs/benchmarks.md).
_BUILD_MEMORY = "512MB"
# The HNSW index's state: true when valid, false when a build failed or is under way.
_INDEX_STATE = (
    "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
    " WHERE c.relname = :name AND c.relnamespace = CAST(:schema AS regnamespace)"
)
# Candidates fetched per hit asked for: re-scored exactly, the best kept.
_OVERSAMPLE = 2
# pgvector's ceiling for hnsw.ef_search.
_MAX_EF_SEARCH = 1000


class PgVectorUnavailable(Exception):
    """MEMORY_PGVECTOR=on, and pgvector cannot be used with this database."""


@dataclass(frozen=True, slots=True)
class Extension:
    """pgvector as installed in the database."""

    schema: str
    version: tuple[int, ...]

    @property
    def iterative_scan(self) -> bool:
        return self.version >= _ITERATIVE_SINCE

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int("".join(itertools.takewhile(str.isdigit, part)) or 0) for part in text.split("."))


async def _installed(conn: AsyncConnection) -> Extension | None:
    row = (
        await conn.execute(
            sa.text(
                "SELECT e.extversion, n.nspname FROM pg_extension e"
                " JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'vector'"
            )
        )
    ).one_or_none()
    return None if row is None else Extension(schema=row.nspname, version=_version(row.extversion))


def _reason(error: BaseException) -> str:
    """The database's own words, without the driver's class names."""
    text = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
    return text.rpartition(">: ")[2] or text


async def find_extension(conn: AsyncConnection) -> tuple[Extension | None, str]:
    """pgvector in this database (created here if the server has it and this
    role may create it), or None and why not."""
    installed = await _installed(conn)
    if installed is None:
        available = (
            await conn.execute(
                sa.text("SELECT default_version FROM pg_available_extensions WHERE name = 'vector'")
            )
        ).scalar_one_or_none()
        if available is None:
            return None, "the database server has no pgvector (no 'vector' in pg_available_extensions)"
        try:
            async with conn.begin_nested():
                await conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS vector"))
        except sa.exc.DBAPIError as error:
            return None, (
                f"pgvector {available} is on the server, but this role cannot create it"
                f" ({_reason(error)}); have a superuser run CREATE EXTENSION vector in this database"
            )
        installed = await _installed(conn)
        if installed is None:
            return None, "CREATE EXTENSION vector left no extension behind"
    if installed.version < _HNSW_SINCE:
        return None, f"pgvector {installed.version_text} has no HNSW index (0.5.0 or later is needed)"
    return installed, ""


class _VectorType(sa.types.UserDefinedType[Any]):
    """pgvector's `vector(n)`, only to CAST to (values travel as `real[]`)."""

    cache_ok = True

    def __init__(self, spec: str) -> None:
        self.spec = spec

    def get_col_spec(self, **_: Any) -> str:
        return self.spec


class PgVectorIndex:
    """Vector search through pgvector's HNSW index (see the module's docstring).

    Args:
        database: the memory's engine (PostgreSQL).
        dimensions: the embedder's vector size (rows of another size are left out).
        extension: pgvector as `find_extension` found it.
        ef_search: candidates the index keeps while it searches
            (`hnsw.ef_search`; at least as many as a search fetches).
        recenter_drift: a language's vectors are centered again once its
            mean has moved this far (Euclidean distance) from the epoch's.
        batch_rows: rows the centering job writes per transaction.
    """

    def __init__(
        self,
        database: Database,
        *,
        dimensions: int,
        extension: Extension,
        ef_search: int = 100,
        recenter_drift: float = 0.02,
        batch_rows: int = 500,
    ) -> None:
        self._db = database
        self.dimensions = dimensions
        self.extension = extension
        self.ef_search = ef_search
        schema = database.engine.dialect.identifier_preparer.quote(extension.schema)
        self._type = _VectorType(f"{schema}.vector({dimensions})")
        self._distance = f"OPERATOR({schema}.<#>)"
        self._opclass = f"{schema}.vector_ip_ops"
        self.centering = Centering(
            database,
            dimensions=dimensions,
            vector_type=self._type.spec,
            drift=recenter_drift,
            batch_rows=batch_rows,
            when_centered=self._build_index,
        )
        self._building = asyncio.Lock()
        self.searches = 0
        self.exact_searches = 0

    @property
    def ready(self) -> bool:
        """Whether every stored vector has its centered copy, in the HNSW
        index (until then, vectors are searched on the numpy path)."""
        return self.centering.ready

    # -- start and stop -----------------------------------------------------

    async def prepare(self) -> None:
        """Adds the centered column, its indexes and the centering table when
        they are missing (a column of another size is made again)."""
        table = f"{SCHEMA}.segment_vectors"
        async with self._db.transaction() as conn:
            await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PREPARE_LOCK})
            size = (
                await conn.execute(
                    sa.text(
                        "SELECT atttypmod FROM pg_attribute WHERE attrelid = CAST(:table AS regclass)"
                        " AND attname = 'centered' AND NOT attisdropped"
                    ),
                    {"table": table},
                )
            ).scalar_one_or_none()
            if size is not None and size != self.dimensions:
                logger.warning(
                    "the centered vectors have %d dimensions and the embedder %d: centering them again",
                    size,
                    self.dimensions,
                )
                # Its indexes go with it.
                await conn.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN centered"))
                await conn.execute(sa.text(f"DROP TABLE IF EXISTS {SCHEMA}.vector_centering"))
                size = None
            if size is None:
                await conn.execute(
                    sa.text(f"ALTER TABLE {table} ADD COLUMN centered {self._type.get_col_spec()}")
                )
            # What the centering job has left to do when pgvector comes to vectors stored before.
            await conn.execute(
                sa.text(
                    f"CREATE INDEX IF NOT EXISTS {UNCENTERED_INDEX} ON {table} (segment_id)"
                    " WHERE centered IS NULL"
                )
            )
            await conn.run_sync(lambda sync: vector_centering.create(sync, checkfirst=True))
            indexed = await self._index_valid(conn)
            self.centering.ready = indexed and not await self.centering.uncentered(conn, limit=1)
        if not self.ready:
            logger.info("centering and indexing the vectors stored before; searching in numpy until then")

    async def _index_valid(self, conn: AsyncConnection) -> bool:
        """Whether the HNSW index is there and whole (a build that failed
        half-way leaves an invalid one behind, as does one under way)."""
        valid = (await conn.execute(sa.text(_INDEX_STATE), {"name": HNSW_INDEX, "schema": SCHEMA})).scalar()
        return bool(valid)

    async def _build_index(self) -> None:
        """Builds the HNSW index over the centered vectors unless it is there.

        On a connection of its own, without a transaction: the advisory lock
        is the session's, and CONCURRENTLY runs outside one (writes go on
        meanwhile). A build that fails or is cancelled closes that
        connection, so that neither the lock nor the setting outlives it.

        Raises:
            IndexBeingBuilt: another replica is building it (the job asks again later).
        """
        async with self._building, self._db.driver_connection() as driver:
            if not await driver.fetchval("SELECT pg_try_advisory_lock($1)", _BUILD_LOCK):
                raise IndexBeingBuilt("another replica is building the HNSW index")
            try:
                await self._build_on(driver)
            except BaseException:
                driver.terminate()
                raise
            await driver.execute("SELECT pg_advisory_unlock($1)", _BUILD_LOCK)

    async def _build_on(self, driver: Any) -> None:
        valid = await driver.fetchval(
            _INDEX_STATE.replace(":name", "$1").replace(":schema", "$2"), HNSW_INDEX, SCHEMA
        )
        if valid:
            return
        if valid is False:
            # Left by a build that failed (nobody else builds: the lock is ours).
            await driver.execute(f"DROP INDEX {SCHEMA}.{HNSW_INDEX}")
        started = time.monotonic()
        await driver.execute(f"SET maintenance_work_mem = '{_BUILD_MEMORY}'")
        await driver.execute(
            f"CREATE INDEX CONCURRENTLY {HNSW_INDEX}"
            f" ON {SCHEMA}.segment_vectors USING hnsw (centered {self._opclass})"
        )
        await driver.execute("RESET maintenance_work_mem")
        logger.info("built the HNSW index of the memory's vectors in %.1f s", time.monotonic() - started)

    def start(self) -> None:
        """Starts the background job that centers vectors again (and those stored before)."""
        self.centering.start()

    async def aclose(self) -> None:
        """Stops the centering job. Idempotent."""
        await self.centering.aclose()

    # -- searching ----------------------------------------------------------

    async def search(
        self, scope: Scope, filters: Filters, query: Vector, language: str, limit: int
    ) -> list[Hit]:
        """The `limit` visible segments nearest `query` (of `language`), scored
        as `search.VectorIndex` scores them."""
        fetch = max(1, limit * _OVERSAMPLE)
        settings = "SELECT set_config('hnsw.ef_search', :ef, true)"
        if self.extension.iterative_scan:
            # Filters are applied as the index is walked: it goes on past
            # ef_search until enough rows pass them (up to hnsw.max_scan_tuples).
            settings += ", set_config('hnsw.iterative_scan', 'relaxed_order', true)"

        ef_search = min(_MAX_EF_SEARCH, max(self.ef_search, fetch))

        async def read() -> tuple[list[Any], LanguageMeans]:
            async with self._db.transaction(write=False, set_local=True) as conn:
                await conn.execute(sa.text(settings), {"ef": str(ef_search)})
                means, epoch_means = await means_and_epochs(conn, self.dimensions)
                # The query as the index's rows are centered: with its language's epoch mean.
                offset = epoch_means.get(language, means.mean(language))
                probe = unit_rows((query.astype(np.float32) - offset)[None, :])[0]
                rows = list((await conn.execute(self._nearest(scope, filters, probe, fetch))).all())
                if len(rows) < fetch:
                    # Too few passed the filters within the index's reach (or
                    # the scope is that small): every visible row, exactly.
                    self.exact_searches += 1
                    exact = self._nearest(scope, filters, probe, fetch, exact=True)
                    rows = list((await conn.execute(exact)).all())
                return rows, means

        rows, means = await self._db.retry_read(read)
        self.searches += 1
        rows = [row for row in rows if len(row.embedding) == 4 * self.dimensions]
        if not rows:
            return []
        keys = np.asarray([row.id for row in rows], dtype=np.int64)
        centered_query = means.center(query.astype(np.float32), language)
        scores = centered_matrix(rows, means, self.dimensions) @ centered_query
        return best_hits(keys, scores, None, limit)

    def _nearest(
        self, scope: Scope, filters: Filters, probe: Vector, fetch: int, *, exact: bool = False
    ) -> sa.Select[Any]:
        target = sa.cast(sa.bindparam("probe", probe.tolist(), type_=postgresql.ARRAY(sa.REAL)), self._type)
        distance = vectors_table.c.centered.op(self._distance, return_type=sa.Float)(target)
        joined = segments.join(vectors_table, vectors_table.c.segment_id == segments.c.id)
        where = [*conditions(scope, filters), vectors_table.c.centered.is_not(None)]
        if not exact:
            return (
                sa.select(segments.c.id, vectors_table.c.embedding, segments.c.language)
                .select_from(joined)
                .where(*where)
                .order_by(distance)
                .limit(fetch)
            )
        # Materialized: the planner cannot take the index for this ordering.
        visible = (
            sa.select(segments.c.id, distance.label("distance"))
            .select_from(joined)
            .where(*where)
            .cte("visible")
            .prefix_with("MATERIALIZED")
        )
        return (
            sa.select(visible.c.id, vectors_table.c.embedding, segments.c.language)
            .select_from(
                visible.join(vectors_table, vectors_table.c.segment_id == visible.c.id).join(
                    segments, segments.c.id == visible.c.id
                )
            )
            .order_by(visible.c.distance, visible.c.id)
            .limit(fetch)
        )
