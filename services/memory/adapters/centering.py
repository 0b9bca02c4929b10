"""The centered copies of the vectors that pgvector's index holds, and the
epochs of the means they are centered with (see `adapters.pgvector`).

A language's epoch is the mean its rows are centered with. Rows stored in an
epoch get that mean; when the language's running mean has moved further
than the drift allowed, a new epoch starts with the current mean, and a
background job rewrites the language's earlier rows a few hundred per
transaction. The same job centers the vectors stored before pgvector (with
it off, or before the extension was installed).

Locks: whoever changes a language's epoch or centers rows with it holds the
language's `vector_centering` row (FOR UPDATE) for the transaction, taken
after the `language_means` rows where both are taken, and in language order:
a row is never centered with a mean that another transaction is replacing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from services.memory.adapters.tables import SCHEMA, language_means, segments
from services.memory.domain.ranking import LanguageMeans

if TYPE_CHECKING:
    from services.memory.adapters.sql import Database

logger = logging.getLogger(__name__)

Vector = npt.NDArray[np.float32]

# How often the job looks for work that another replica left, and waits after a failure.
_POLL_SECONDS = 60.0
_RETRY_SECONDS = 5.0


class IndexBeingBuilt(Exception):
    """Another replica is building the index (`when_centered`): the job asks again later."""


vector_centering = sa.Table(
    "vector_centering",
    sa.MetaData(schema=SCHEMA),
    sa.Column("language", sa.String(8), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    # float32 little-endian: the mean this epoch's rows are centered with.
    sa.Column("mean", sa.LargeBinary, nullable=False),
    # Rows of the language up to this segment id may still be centered with
    # an earlier epoch's mean; the job has done them up to `done_through`.
    sa.Column("stale_through", sa.BigInteger, nullable=False),
    sa.Column("done_through", sa.BigInteger, nullable=False),
)

# `segment_vectors` with the column that exists only where pgvector does.
vectors_table = sa.table(
    "segment_vectors",
    sa.column("segment_id", sa.BigInteger),
    sa.column("embedding", sa.LargeBinary),
    sa.column("centered"),
    schema=SCHEMA,
)


def unit_rows(matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return (matrix / np.where(norms > 0, norms, 1.0)).astype(np.float32)


async def means_and_epochs(conn: AsyncConnection, dimensions: int) -> tuple[LanguageMeans, dict[str, Vector]]:
    """The languages' current means (as `search.load_means` reads them) and
    the means of their epochs, in one statement."""
    rows = (
        await conn.execute(
            sa.select(language_means, vector_centering.c.mean.label("epoch_mean")).outerjoin(
                vector_centering, vector_centering.c.language == language_means.c.language
            )
        )
    ).all()
    state = {
        row.language: (int(row._mapping["count"]), np.frombuffer(row.sums, dtype="<f8").tolist())
        for row in rows
    }
    means = LanguageMeans.restored(dimensions, {k: v for k, v in state.items() if len(v[1]) == dimensions})
    epochs = {
        row.language: np.frombuffer(row.epoch_mean, dtype="<f4").astype(np.float32)
        for row in rows
        if row.epoch_mean is not None and len(row.epoch_mean) == 4 * dimensions
    }
    return means, epochs


class Centering:
    """Writes the centered copies of vectors, and runs the job that keeps them centered.

    Args:
        database: the memory's engine (PostgreSQL).
        dimensions: the embedder's vector size (rows of another size are left alone).
        vector_type: pgvector's type of the column, as SQL (`public.vector(384)`).
        drift: a language starts a new epoch once its mean has moved this
            far (Euclidean distance) from the epoch's.
        batch_rows: rows the job writes per transaction.
        when_centered: awaited once every stored vector is centered, before
            the job says so (`ready`): builds the index they need.
    """

    def __init__(
        self,
        database: Database,
        *,
        dimensions: int,
        vector_type: str,
        drift: float,
        batch_rows: int,
        when_centered: Callable[[], Awaitable[None]],
    ) -> None:
        self._db = database
        self.dimensions = dimensions
        self._type = vector_type
        self.drift = drift
        self._batch = batch_rows
        # Whether every stored vector of the right size has its centered copy
        # (and `when_centered` is done).
        self.ready = False
        self._when_centered = when_centered
        self._backfilled_to = 0
        self._wake = asyncio.Event()
        self._job: asyncio.Task[None] | None = None
        self.epochs_started = 0
        self.rows_centered = 0

    # -- writing ------------------------------------------------------------

    async def insert(
        self, conn: AsyncConnection, rows: Sequence[tuple[int, str, Vector]], means: LanguageMeans
    ) -> bool:
        """Stores vectors (segment key, language, vector) with their centered
        copies, in the caller's transaction, after the language sums were
        updated (`means` holds the new means of these languages). Returns
        whether a language started a new epoch (then `wake` the job once
        the transaction is committed)."""
        if not rows:
            return False
        epoch_means, started = await self.epoch_means(conn, means, {language for _, language, _ in rows})
        vectors = np.stack([np.asarray(vector, dtype="<f4") for _, _, vector in rows])
        centered = unit_rows(vectors - np.stack([epoch_means[language] for _, language, _ in rows]))
        await conn.execute(
            sa.text(
                f"INSERT INTO {SCHEMA}.segment_vectors (segment_id, embedding, centered)"
                f" VALUES (:key, :embedding, CAST(CAST(:centered AS real[]) AS {self._type}))"
            ),
            [
                {"key": key, "embedding": vectors[i].tobytes(), "centered": centered[i].tolist()}
                for i, (key, _, _) in enumerate(rows)
            ],
        )
        return started

    async def epoch_means(
        self, conn: AsyncConnection, means: LanguageMeans, languages: set[str]
    ) -> tuple[dict[str, Vector], bool]:
        """The means to center rows of these languages with (their epochs'),
        locked until the transaction ends; a language whose mean has moved
        further than the drift allows gets a new epoch with its current mean
        (`means`), and so does one seen for the first time. Returns them and
        whether an epoch started."""
        names = sorted(languages)
        current = {language: means.mean(language) for language in names}
        await conn.execute(
            postgresql.insert(vector_centering)
            .values(
                [
                    {
                        "language": language,
                        "epoch": 1,
                        "mean": current[language].astype("<f4").tobytes(),
                        "stale_through": 0,
                        "done_through": 0,
                    }
                    for language in names
                ]
            )
            .on_conflict_do_nothing()
        )
        stored = (
            await conn.execute(
                sa.select(vector_centering.c.language, vector_centering.c.mean)
                .where(vector_centering.c.language.in_(names))
                .order_by(vector_centering.c.language)
                .with_for_update()
            )
        ).all()
        chosen: dict[str, Vector] = {}
        started = False
        for row in stored:
            mean = np.frombuffer(row.mean, dtype="<f4").astype(np.float32)
            now = current[row.language]
            if len(mean) == self.dimensions and float(np.linalg.norm(now - mean)) <= self.drift:
                chosen[row.language] = mean
                continue
            # Any row stored so far may be of this language: the job goes up to the last one.
            last = (
                await conn.execute(sa.select(sa.func.coalesce(sa.func.max(vectors_table.c.segment_id), 0)))
            ).scalar_one()
            await conn.execute(
                vector_centering.update()
                .where(vector_centering.c.language == row.language)
                .values(
                    epoch=vector_centering.c.epoch + 1,
                    mean=now.astype("<f4").tobytes(),
                    stale_through=int(last),
                    done_through=0,
                )
            )
            chosen[row.language] = now
            started = True
            self.epochs_started += 1
        return chosen, started

    # -- the job ------------------------------------------------------------

    def start(self) -> None:
        if self._job is None:
            self._job = asyncio.create_task(self._run(), name="memory-vector-centering")

    def wake(self) -> None:
        self._wake.set()

    async def aclose(self) -> None:
        """Stops the job. Idempotent."""
        job, self._job = self._job, None
        if job is not None:
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                worked = await self.center_some()
            except Exception as error:  # an outage, or another replica's index build: the job goes on
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # Stopping: an error in the clean-up of what was cancelled must not swallow it.
                    raise asyncio.CancelledError from error
                logger.log(
                    logging.INFO if isinstance(error, IndexBeingBuilt) else logging.WARNING,
                    "centering vectors paused (%s); trying again shortly",
                    error,
                    exc_info=not isinstance(error, IndexBeingBuilt),
                )
                await asyncio.sleep(_RETRY_SECONDS)
                continue
            if not worked:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _POLL_SECONDS)

    async def center_some(self) -> bool:
        """One transaction's worth of the job: vectors stored before pgvector
        first, then a language whose epoch changed. Returns whether there was any."""
        if not self.ready:
            if await self._backfill():
                return True
            await self._when_centered()
            self.ready = True
            logger.info("every stored vector is centered: vectors are searched in PostgreSQL")
        return await self._recenter()

    async def settled(self) -> None:
        """Returns once the job has nothing left to do (for tests and benchmarks)."""
        while await self.center_some():
            pass

    async def uncentered(self, conn: AsyncConnection, *, limit: int, after: int = 0) -> list[Any]:
        """Stored vectors of the right size without their centered copy, by key."""
        found = await conn.execute(
            sa.select(vectors_table.c.segment_id.label("id"), vectors_table.c.embedding, segments.c.language)
            .join(segments, segments.c.id == vectors_table.c.segment_id)
            .where(
                vectors_table.c.centered.is_(None),
                vectors_table.c.segment_id > after,
                sa.func.octet_length(vectors_table.c.embedding) == 4 * self.dimensions,
            )
            .order_by(vectors_table.c.segment_id)
            .limit(limit)
        )
        return list(found.all())

    async def _backfill(self) -> bool:
        async with self._db.transaction() as conn:
            rows = await self.uncentered(conn, limit=self._batch, after=self._backfilled_to)
            if not rows:
                return False
            means, _ = await means_and_epochs(conn, self.dimensions)
            epoch_means, started = await self.epoch_means(conn, means, {row.language for row in rows})
            await self._write(conn, rows, [epoch_means[row.language] for row in rows])
        self._backfilled_to = int(rows[-1].id)
        if started:
            self.wake()
        return True

    async def _recenter(self) -> bool:
        async with self._db.transaction() as conn:
            # Locked against a new epoch starting meanwhile; another replica's
            # job takes another language.
            state = (
                await conn.execute(
                    sa.select(vector_centering)
                    .where(vector_centering.c.done_through < vector_centering.c.stale_through)
                    .order_by(vector_centering.c.language)
                    .limit(1)
                    .with_for_update(skip_locked=True)
                )
            ).one_or_none()
            if state is None:
                return False
            # A window of keys per transaction, however rare the language.
            upper = min(int(state.stale_through), int(state.done_through) + 10 * self._batch)
            rows = (
                await conn.execute(
                    sa.select(vectors_table.c.segment_id.label("id"), vectors_table.c.embedding)
                    .join(segments, segments.c.id == vectors_table.c.segment_id)
                    .where(
                        vectors_table.c.segment_id > state.done_through,
                        vectors_table.c.segment_id <= upper,
                        segments.c.language == state.language,
                        sa.func.octet_length(vectors_table.c.embedding) == 4 * self.dimensions,
                    )
                    .order_by(vectors_table.c.segment_id)
                    .limit(self._batch)
                )
            ).all()
            if len(rows) == self._batch:
                upper = int(rows[-1].id)
            mean = np.frombuffer(state.mean, dtype="<f4").astype(np.float32)
            if rows and len(mean) == self.dimensions:
                await self._write(conn, rows, [mean] * len(rows))
            await conn.execute(
                vector_centering.update()
                .where(vector_centering.c.language == state.language)
                .values(done_through=upper)
            )
        return True

    async def _write(self, conn: AsyncConnection, rows: Sequence[Any], offsets: Sequence[Vector]) -> None:
        vectors = np.frombuffer(b"".join(row.embedding for row in rows), dtype="<f4")
        centered = unit_rows(vectors.reshape(len(rows), self.dimensions) - np.stack(offsets))
        await conn.execute(
            sa.text(
                f"UPDATE {SCHEMA}.segment_vectors"
                f" SET centered = CAST(CAST(:centered AS real[]) AS {self._type}) WHERE segment_id = :key"
            ),
            [{"key": int(row.id), "centered": centered[i].tolist()} for i, row in enumerate(rows)],
        )
        self.rows_centered += len(rows)
