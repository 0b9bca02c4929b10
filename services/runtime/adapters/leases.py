"""Shard leases in the runtime's database (SQLite or PostgreSQL).

Every time is the database's: `database_now` is PostgreSQL's
`clock_timestamp()` (or SQLite's `julianday('now')`) in seconds since the
epoch, so a lease expires when the database says so, whatever a replica's
clock says. On PostgreSQL a renewal is one statement whatever the number of
shards (the replica's heartbeat rides in a CTE).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from services.runtime.adapters.tables import replicas, shard_leases
from services.runtime.service_layer.leases import Fence, LeaseLost, LeaseStore, LeaseView, ReplicaReport

if TYPE_CHECKING:  # the store's module fences its own writes with `check_fence`
    from services.runtime.adapters.sql import Database


def database_now(dialect: str) -> sa.ColumnElement[float]:
    """The database's current time, in seconds since the epoch."""
    if dialect == "postgresql":
        return sa.literal_column("extract(epoch from clock_timestamp())::float8", sa.Float)
    return sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)", sa.Float)


class SqlLeases(LeaseStore):
    def __init__(self, database: Database) -> None:
        self._database = database
        self._dialect = "sqlite" if database.is_sqlite else "postgresql"

    def _now(self) -> sa.ColumnElement[float]:
        return database_now(self._dialect)

    async def prepare(self, shard_count: int) -> None:
        insert: Any = sqlite.insert if self._dialect == "sqlite" else postgresql.insert
        async with self._database.transaction() as conn:
            existing = (await conn.execute(sa.select(sa.func.count()).select_from(shard_leases))).scalar_one()
            if existing > shard_count:
                highest = (await conn.execute(sa.select(sa.func.max(shard_leases.c.shard)))).scalar_one()
                if highest >= shard_count:
                    raise ValueError(
                        f"the database has {existing} shards and this replica was configured with "
                        f"{shard_count}: every replica must use the same RUNTIME_SHARDS"
                    )
            if existing < shard_count:
                await conn.execute(
                    insert(shard_leases)
                    .values([{"shard": shard} for shard in range(shard_count)])
                    .on_conflict_do_nothing(index_elements=["shard"])
                )

    async def renew(self, replica: str, address: str, ttl_seconds: float, report: str = "") -> dict[int, int]:
        now = self._now()
        ttl = sa.literal(ttl_seconds, sa.Float)
        insert: Any = sqlite.insert if self._dialect == "sqlite" else postgresql.insert
        beat = insert(replicas).values(
            id=replica, address=address, started_at=now, expires_at=now + ttl, reported_at=now, report=report
        )
        beat = beat.on_conflict_do_update(
            index_elements=["id"],
            set_={"address": address, "expires_at": now + ttl, "reported_at": now, "report": report},
        )
        extend = (
            sa.update(shard_leases)
            .where(shard_leases.c.owner == replica)
            .values(expires_at=now + ttl)
            .returning(shard_leases.c.shard, shard_leases.c.epoch)
        )
        async with self._database.transaction() as conn:
            if self._dialect == "postgresql":
                rows = await conn.execute(extend.add_cte(beat.cte("beat")))
            else:
                await conn.execute(beat)
                rows = await conn.execute(extend)
            return {row.shard: row.epoch for row in rows}

    async def view(self) -> LeaseView:
        now = self._now()

        async def read() -> LeaseView:
            async with self._database.transaction(write=False) as conn:
                at = (await conn.execute(sa.select(now))).scalar_one()
                live = await conn.execute(sa.select(replicas.c.id).where(replicas.c.expires_at > at))
                owned = await conn.execute(
                    sa.select(shard_leases.c.shard, shard_leases.c.owner).where(
                        shard_leases.c.owner.is_not(None), shard_leases.c.expires_at > at
                    )
                )
                return LeaseView(
                    replicas=tuple(sorted(row.id for row in live)),
                    owners={row.shard: row.owner for row in owned},
                    now=at,
                )

        return await self._database.retry_read(read)

    async def live_replicas(self) -> list[ReplicaReport]:
        now = self._now()

        async def read() -> list[ReplicaReport]:
            async with self._database.transaction(write=False) as conn:
                rows = await conn.execute(
                    sa.select(replicas).where(replicas.c.expires_at > now).order_by(replicas.c.id)
                )
                return [
                    ReplicaReport(row.id, row.address, row.started_at, row.reported_at, row.report)
                    for row in rows
                ]

        return await self._database.retry_read(read)

    async def take(self, replica: str, shards: Collection[int], ttl_seconds: float) -> dict[int, int]:
        if not shards:
            return {}
        now = self._now()
        statement = (
            sa.update(shard_leases)
            .where(
                shard_leases.c.shard.in_(sorted(shards)),
                sa.or_(shard_leases.c.owner.is_(None), shard_leases.c.expires_at <= now),
            )
            .values(
                owner=replica,
                epoch=shard_leases.c.epoch + 1,
                expires_at=now + sa.literal(ttl_seconds, sa.Float),
            )
            .returning(shard_leases.c.shard, shard_leases.c.epoch)
        )
        async with self._database.transaction() as conn:
            return {row.shard: row.epoch for row in await conn.execute(statement)}

    async def release(self, replica: str, shards: Collection[int]) -> None:
        if not shards:
            return
        async with self._database.transaction() as conn:
            await conn.execute(self._release(replica).where(shard_leases.c.shard.in_(sorted(shards))))

    async def leave(self, replica: str) -> None:
        async with self._database.transaction() as conn:
            await conn.execute(self._release(replica))
            await conn.execute(sa.delete(replicas).where(replicas.c.id == replica))

    def _release(self, replica: str) -> sa.Update:
        return (
            sa.update(shard_leases)
            .where(shard_leases.c.owner == replica)
            .values(owner=None, epoch=shard_leases.c.epoch + 1, expires_at=self._now())
        )


async def check_fence(conn: AsyncConnection, fence: Fence) -> None:
    """Refuses the transaction of `conn` unless `fence` is still the shard's
    lease: the row is locked FOR SHARE until the transaction ends, so a take
    (which updates it) waits for this write to commit, and a write that starts
    after the take sees the new epoch. On SQLite every write transaction holds
    the database's one write lock, which orders them the same way.

    Raises:
        LeaseLost: the shard's epoch or owner is no longer the fence's.
    """
    statement = sa.select(shard_leases.c.shard).where(
        shard_leases.c.shard == fence.shard,
        shard_leases.c.epoch == fence.epoch,
        shard_leases.c.owner == fence.replica,
    )
    if conn.dialect.name == "postgresql":
        statement = statement.with_for_update(read=True)
    if (await conn.execute(statement)).first() is None:
        raise LeaseLost.of(fence)
