"""The audit log in SQL, the same for every service (each in its own schema).

`audit_table` defines the table in a service's metadata; `insert_record`
adds a record in a transaction the caller holds (a handler's change);
`SqlAuditLog` is the `AuditLog` for what is recorded on its own (refusals,
listing, pruning).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.common.audit import Actor, AuditLog, AuditQuery, AuditRecord, Cursor, OutcomeFilter, Target
from services.common.outages import DATABASE, as_unavailable
from services.common.sql import SqlDatabase, UtcDateTime


def audit_table(metadata: sa.MetaData, name: str = "audit_events") -> sa.Table:
    """A service's audit table, in its schema. Its name differs per service:
    on SQLite the services may share one file, where schemas are translated away."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("workspace_id", sa.Uuid, nullable=True),
        sa.Column("actor_kind", sa.String(16), nullable=False),
        sa.Column("actor_member_id", sa.Uuid, nullable=True),
        sa.Column("actor_service", sa.String(64), nullable=True),
        # The actor as one string (member id or service:<name>), for the filter and for collapsing.
        sa.Column("actor_key", sa.String(80), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target_kind", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(200), nullable=False),
        sa.Column("at", UtcDateTime, nullable=False),
        sa.Column("last_at", UtcDateTime, nullable=False),
        sa.Column("code", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("details", sa.JSON, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        # Listing: a workspace's records newest first.
        sa.Index(f"ix_{name}_workspace_at", "workspace_id", "at", "id"),
        # Pruning by age.
        sa.Index(f"ix_{name}_at", "at"),
    )


def record_values(record: AuditRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "workspace_id": record.workspace_id,
        "actor_kind": record.actor.kind,
        "actor_member_id": record.actor.member_id,
        "actor_service": record.actor.service,
        "actor_key": record.actor.key[:80],
        "action": record.action[:64],
        "target_kind": record.target.kind[:32],
        "target_id": record.target.id[:200],
        "at": record.at,
        "last_at": record.last_at or record.at,
        "code": record.code[:32],
        "reason": record.reason,
        "request_id": record.request_id[:128],
        "details": dict(record.details),
        "count": record.count,
    }


async def insert_record(conn: AsyncConnection, table: sa.Table, record: AuditRecord) -> None:
    """Adds the record in the connection's transaction (with the change it records)."""
    await conn.execute(table.insert().values(**record_values(record)))


def _record(row: sa.Row[Any]) -> AuditRecord:
    return AuditRecord(
        id=row.id,
        workspace_id=row.workspace_id,
        actor=Actor(row.actor_kind, member_id=row.actor_member_id, service=row.actor_service),
        action=row.action,
        target=Target(row.target_kind, row.target_id),
        at=row.at,
        code=row.code,
        reason=row.reason,
        request_id=row.request_id,
        details=dict(row.details or {}),
        count=int(row._mapping["count"]),
        last_at=row.last_at,
    )


class SqlAuditLog(AuditLog):
    """A service's `audit_events` table.

    Args:
        database: the service's database (its write lock serialises SQLite writers).
        table: the table, from `audit_table`.
    """

    def __init__(self, database: SqlDatabase, table: sa.Table) -> None:
        self._db = database
        self._table = table

    @contextlib.asynccontextmanager
    async def _transaction(self, *, write: bool) -> AsyncIterator[AsyncConnection]:
        with as_unavailable(DATABASE):
            async with contextlib.AsyncExitStack() as stack:
                if self._db.is_sqlite and write:
                    await stack.enter_async_context(self._db.write_lock)
                conn = await stack.enter_async_context(self._db.engine.connect())
                if write:
                    conn = await conn.execution_options(**{self._db.write_option: True})
                async with conn.begin():
                    yield conn

    async def record(self, record: AuditRecord) -> None:
        async with self._transaction(write=True) as conn:
            await insert_record(conn, self._table, record)

    async def record_refusal(self, record: AuditRecord, *, window: timedelta) -> None:
        t = self._table
        async with self._transaction(write=True) as conn:
            if window > timedelta(0):
                # The newest record of the same refusal still in its window counts this one.
                same = (
                    sa.select(t.c.id)
                    .where(
                        t.c.workspace_id == record.workspace_id,
                        t.c.actor_key == record.actor.key[:80],
                        t.c.action == record.action[:64],
                        t.c.target_id == record.target.id[:200],
                        t.c.code == record.code[:32],
                        t.c.at > sa.literal(record.at - window, UtcDateTime),
                    )
                    .order_by(t.c.at.desc(), t.c.id.desc())
                    .limit(1)
                )
                if not self._db.is_sqlite:
                    same = same.with_for_update()
                found = (await conn.execute(same)).scalar()
                if found is not None:
                    await conn.execute(
                        t.update()
                        .where(t.c.id == found)
                        .values(count=t.c.count + 1, last_at=record.at, reason=record.reason)
                    )
                    return
            await insert_record(conn, t, record)

    async def list(
        self, workspace_id: uuid.UUID, query: AuditQuery, *, after: Cursor | None, limit: int
    ) -> list[AuditRecord]:
        t = self._table
        statement = sa.select(t).where(t.c.workspace_id == workspace_id)
        if query.actor:
            statement = statement.where(t.c.actor_key == query.actor)
        if query.action:
            statement = statement.where(t.c.action == query.action)
        if query.target_id:
            statement = statement.where(t.c.target_id == query.target_id)
        if query.start is not None:
            statement = statement.where(t.c.at >= sa.literal(query.start, UtcDateTime))
        if query.end is not None:
            statement = statement.where(t.c.at < sa.literal(query.end, UtcDateTime))
        if query.outcome == OutcomeFilter.OK:
            statement = statement.where(t.c.code == "OK")
        elif query.outcome == OutcomeFilter.REFUSED:
            statement = statement.where(t.c.code != "OK")
        if after is not None:
            at = sa.literal(after.at, UtcDateTime)
            statement = statement.where(sa.or_(t.c.at < at, sa.and_(t.c.at == at, t.c.id < after.id)))
        statement = statement.order_by(t.c.at.desc(), t.c.id.desc()).limit(limit)

        async def read() -> list[AuditRecord]:
            async with self._transaction(write=False) as conn:
                return [_record(r) for r in (await conn.execute(statement)).all()]

        return await self._db.retry_read(read)

    async def prune(self, *, before: datetime) -> int:
        async with self._transaction(write=True) as conn:
            result = await conn.execute(
                self._table.delete().where(self._table.c.at < sa.literal(before, UtcDateTime))
            )
            return int(result.rowcount or 0)
