"""The IM's storage on SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).

`Database` owns the engine; `SqlTransaction` implements the `Transaction`
port with SQLAlchemy Core statements that run unchanged on both backends.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from services.common.audit import AuditRecord
from services.common.audit_sql import record_values
from services.common.outages import DATABASE, as_unavailable, describe, unavailable_error
from services.common.sql import SqlDatabase, SqliteWorker, UtcDateTime
from services.im.adapters import codec
from services.im.adapters.auth_sql import SqlAuthRecords
from services.im.adapters.tables import (
    SCHEMA,
    audit_events,
    event_counters,
    events,
    groups,
    members,
    memberships,
    messages,
    requests,
    workspaces,
)
from services.im.domain.model import (
    NIL_ID,
    ContentType,
    Event,
    Group,
    GroupChanged,
    GroupKind,
    Member,
    MemberKind,
    Membership,
    Message,
    RecordedEvent,
    Role,
    Workspace,
    event_group_id,
)
from services.im.service_layer.ports import (
    DuplicateRequest,
    GroupAccess,
    Transaction,
)

logger = logging.getLogger(__name__)


class Database(SqlDatabase):
    """The IM's engine (schema `im`); `transaction()` opens a unit of work."""

    def __init__(self, url: str, *, pool_size: int = 16, busy_timeout_seconds: float = 10.0) -> None:
        super().__init__(
            url,
            schema=SCHEMA,
            write_option="im_write",
            pool_size=pool_size,
            busy_timeout_seconds=busy_timeout_seconds,
        )
        self._sqlite: SqliteWorker | None = None

    def transaction(self, *, write: bool = True) -> SqlTransaction:
        return SqlTransaction(self, write=write)

    @property
    def sqlite(self) -> SqliteWorker:
        """The dedicated SQLite connections the hot paths share (SQLite only; made on first use)."""
        if self._sqlite is None:
            self._sqlite = SqliteWorker(self, name="im-sqlite")
        return self._sqlite

    async def aclose(self) -> None:
        """Closes the hot paths' SQLite connections and the pooled ones. Idempotent."""
        if self._sqlite is not None:
            await self._sqlite.aclose()
        await super().aclose()


def _dialect_insert(database: Database) -> Any:
    """The backend's INSERT construct, which knows ON CONFLICT."""
    return sqlite_insert if database.is_sqlite else postgresql_insert


def _workspace(row: sa.Row[Any]) -> Workspace:
    return Workspace(id=row.id, name=row.name, created_at=row.created_at)


def _member(row: sa.Row[Any]) -> Member:
    return Member(
        id=row.id,
        workspace_id=row.workspace_id,
        kind=MemberKind(row.kind),
        display_name=row.display_name,
        avatar=row.avatar,
        created_at=row.created_at,
        role=Role(row.role),
        host=row.host,
        owner_id=row.owner_id,
    )


def _message(row: sa.Row[Any]) -> Message:
    return Message(
        id=row.id,
        workspace_id=row.workspace_id,
        group_id=row.group_id,
        sender_id=row.sender_id,
        content_type=ContentType(row.content_type),
        content=row.content,
        mentions=tuple(uuid.UUID(m) for m in row.mentions),
        reply_to=row.reply_to,
        metadata=row.metadata,
        sent_at=row.sent_at,
        edited_at=row.edited_at,
        request_id=row.request_id,
        request_hash=row.request_hash,
    )


def _message_values(message: Message) -> dict[str, Any]:
    return {
        "id": message.id,
        "workspace_id": message.workspace_id,
        "group_id": message.group_id,
        "sender_id": message.sender_id,
        "content_type": message.content_type.value,
        "content": message.content,
        "mentions": [str(m) for m in message.mentions],
        "reply_to": message.reply_to,
        "metadata": message.metadata,
        "sent_at": message.sent_at,
        "edited_at": message.edited_at,
        "request_id": message.request_id,
        "request_hash": message.request_hash,
    }


class SqlTransaction(SqlAuthRecords, Transaction):
    """One database transaction on its own connection.

    Failures that mean the database cannot serve leave it as
    `DependencyUnavailable`. On PostgreSQL a read transaction is a series of
    statements that each see committed data (no snapshot to keep), so a
    statement whose connection broke goes again once on a new connection.
    """

    def __init__(self, database: Database, *, write: bool) -> None:
        self._db = database
        self._write = write
        self._conn: AsyncConnection | None = None
        self._locked = False
        self._finished = False

    async def __aenter__(self) -> Self:
        if self._db.is_sqlite and self._write:
            await self._db.write_lock.acquire()
            self._locked = True
        try:
            with as_unavailable(DATABASE):
                self._conn = await self._connect()
        except BaseException:
            self._release_lock()
            raise
        return self

    async def _connect(self) -> AsyncConnection:
        conn = await self._db.engine.connect()
        try:
            if self._write:
                conn = await conn.execution_options(im_write=True)
            elif not self._db.is_sqlite:
                # Reads need no BEGIN/COMMIT round trips; each query sees committed data.
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.begin()
        except BaseException:
            await conn.close()
            raise
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with as_unavailable(DATABASE):
            # Ended in a task of its own: a caller cancelled again while the
            # connection goes back to the pool (a client that went away, then
            # a deadline) would leave it half-closed and, on SQLite, keep
            # this process's write lock forever. The caller stops waiting;
            # the ending goes on.
            await asyncio.shield(asyncio.ensure_future(self._end()))
        if exc is not None:
            unavailable = unavailable_error(exc, dependency=DATABASE)
            if unavailable is not None and unavailable is not exc:
                raise unavailable from exc

    async def _end(self) -> None:
        try:
            await self.rollback()
        finally:
            try:
                if self._conn is not None:
                    conn, self._conn = self._conn, None
                    await conn.close()
            finally:
                self._release_lock()

    def _release_lock(self) -> None:
        if self._locked:
            self._locked = False
            self._db.write_lock.release()

    @property
    def on_sqlite(self) -> bool:
        return self._db.is_sqlite

    @property
    def conn(self) -> AsyncConnection:
        assert self._conn is not None, "use the transaction inside `async with`"
        return self._conn

    async def commit(self) -> None:
        await self.conn.commit()
        self._finished = True

    async def rollback(self) -> None:
        if not self._finished and self._conn is not None:
            self._finished = True
            await self._conn.rollback()

    async def _execute(self, statement: sa.Executable, parameters: Any = None) -> sa.CursorResult[Any]:
        try:
            return await self.conn.execute(statement, parameters)
        except sa.exc.DBAPIError as error:
            if self._write or self._db.is_sqlite or not error.connection_invalidated:
                raise
            logger.info("a database read lost its connection (%s); reading again", describe(error))
        # SQLAlchemy has invalidated the broken connection; take a new one.
        await self.conn.close()
        self._conn = None
        self._conn = await self._connect()
        return await self.conn.execute(statement, parameters)

    async def _rows(self, statement: sa.Executable) -> Sequence[sa.Row[Any]]:
        return (await self._execute(statement)).all()

    # -- workspaces ---------------------------------------------------------

    async def add_workspace(self, workspace: Workspace) -> None:
        await self._execute(
            workspaces.insert().values(id=workspace.id, name=workspace.name, created_at=workspace.created_at)
        )
        await self._execute(event_counters.insert().values(workspace_id=workspace.id, last_sequence=0))

    async def get_workspace(self, workspace_id: uuid.UUID) -> Workspace | None:
        rows = await self._rows(workspaces.select().where(workspaces.c.id == workspace_id))
        return _workspace(rows[0]) if rows else None

    async def list_workspaces(
        self, *, ids: list[uuid.UUID] | None, after: uuid.UUID | None, limit: int
    ) -> list[Workspace]:
        query = workspaces.select().order_by(workspaces.c.id).limit(limit)
        if ids is not None:
            query = query.where(workspaces.c.id.in_(ids))
        if after is not None:
            query = query.where(workspaces.c.id > after)
        return [_workspace(r) for r in await self._rows(query)]

    # -- members ------------------------------------------------------------

    async def add_member(self, member: Member) -> None:
        await self._execute(
            members.insert().values(
                id=member.id,
                workspace_id=member.workspace_id,
                kind=member.kind.value,
                display_name=member.display_name,
                avatar=member.avatar,
                created_at=member.created_at,
                role=member.role.value,
                host=member.host,
                owner_id=member.owner_id,
            )
        )

    async def get_member(self, member_id: uuid.UUID) -> Member | None:
        rows = await self._rows(members.select().where(members.c.id == member_id))
        return _member(rows[0]) if rows else None

    async def get_members(self, member_ids: list[uuid.UUID]) -> dict[uuid.UUID, Member]:
        if not member_ids:
            return {}
        rows = await self._rows(members.select().where(members.c.id.in_(member_ids)))
        return {r.id: _member(r) for r in rows}

    async def list_members(
        self, workspace_id: uuid.UUID, *, after: uuid.UUID | None, limit: int
    ) -> list[Member]:
        query = (
            members.select().where(members.c.workspace_id == workspace_id).order_by(members.c.id).limit(limit)
        )
        if after is not None:
            query = query.where(members.c.id > after)
        return [_member(r) for r in await self._rows(query)]

    async def update_member(self, member: Member) -> None:
        await self._execute(
            members.update()
            .where(members.c.id == member.id)
            .values(display_name=member.display_name, avatar=member.avatar)
        )

    async def set_owner(self, member_id: uuid.UUID, owner_id: uuid.UUID) -> bool:
        result = await self._execute(
            members.update()
            .where(
                members.c.id == member_id,
                sa.or_(members.c.owner_id.is_(None), members.c.owner_id != owner_id),
            )
            .values(owner_id=owner_id)
        )
        return bool(result.rowcount)

    # -- quotas and the audit log ---------------------------------------------

    async def lock_workspace(self, workspace_id: uuid.UUID) -> bool:
        # SQLite has one writer at a time already; PostgreSQL holds the row
        # until the transaction ends, so counting and inserting cannot interleave.
        statement = sa.select(workspaces.c.id).where(workspaces.c.id == workspace_id)
        if not self._db.is_sqlite:
            statement = statement.with_for_update()
        return bool(await self._rows(statement))

    async def count_members(self, workspace_id: uuid.UUID, kind: MemberKind) -> int:
        rows = await self._rows(
            sa.select(sa.func.count())
            .select_from(members)
            .where(members.c.workspace_id == workspace_id, members.c.kind == kind.value)
        )
        return int(rows[0][0])

    async def count_groups(self, workspace_id: uuid.UUID, kind: GroupKind) -> int:
        rows = await self._rows(
            sa.select(sa.func.count())
            .select_from(groups)
            .where(groups.c.workspace_id == workspace_id, groups.c.kind == kind.value)
        )
        return int(rows[0][0])

    async def add_audit(self, record: AuditRecord) -> None:
        await self._execute(audit_events.insert().values(**record_values(record)))

    # -- groups -------------------------------------------------------------

    async def add_group(self, group: Group) -> None:
        try:
            await self._execute(
                groups.insert().values(
                    id=group.id,
                    workspace_id=group.workspace_id,
                    name=group.name,
                    kind=group.kind.value,
                    creator_id=group.creator_id,
                    created_at=group.created_at,
                    direct_key=group.direct_key,
                )
            )
        except sa.exc.IntegrityError as error:
            if group.direct_key is None:
                raise
            raise DuplicateRequest(group.direct_key) from error
        await self.add_memberships(group.id, list(group.member_ids), group.created_at)

    async def _member_ids(self, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[uuid.UUID, ...]]:
        if not group_ids:
            return {}
        rows = await self._rows(
            sa.select(memberships.c.group_id, memberships.c.member_id)
            .where(memberships.c.group_id.in_(group_ids))
            .order_by(memberships.c.joined_at, memberships.c.member_id)
        )
        found: dict[uuid.UUID, list[uuid.UUID]] = {g: [] for g in group_ids}
        for row in rows:
            found[row.group_id].append(row.member_id)
        return {g: tuple(ids) for g, ids in found.items()}

    async def _groups(self, rows: Iterable[sa.Row[Any]]) -> list[Group]:
        rows = list(rows)
        ids = await self._member_ids([r.id for r in rows])
        return [
            Group(
                id=r.id,
                workspace_id=r.workspace_id,
                name=r.name,
                kind=GroupKind(r.kind),
                creator_id=r.creator_id,
                created_at=r.created_at,
                member_ids=ids[r.id],
                direct_key=r.direct_key,
            )
            for r in rows
        ]

    async def get_group(self, group_id: uuid.UUID) -> Group | None:
        found = await self._groups(await self._rows(groups.select().where(groups.c.id == group_id)))
        return found[0] if found else None

    async def find_direct_group(self, workspace_id: uuid.UUID, direct_key: str) -> Group | None:
        query = groups.select().where(
            groups.c.workspace_id == workspace_id, groups.c.direct_key == direct_key
        )
        found = await self._groups(await self._rows(query))
        return found[0] if found else None

    async def list_groups_of(
        self, member_id: uuid.UUID, *, after: uuid.UUID | None, limit: int | None
    ) -> list[Group]:
        query = (
            sa.select(groups)
            .join(memberships, memberships.c.group_id == groups.c.id)
            .where(memberships.c.member_id == member_id)
            .order_by(groups.c.id)
        )
        if after is not None:
            query = query.where(groups.c.id > after)
        if limit is not None:
            query = query.limit(limit)
        return await self._groups(await self._rows(query))

    async def rename_group(self, group_id: uuid.UUID, name: str) -> None:
        await self._execute(groups.update().where(groups.c.id == group_id).values(name=name))

    async def add_memberships(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], joined_at: datetime
    ) -> None:
        if member_ids:
            await self._execute(
                memberships.insert(),
                [
                    {
                        "group_id": group_id,
                        "member_id": m,
                        "last_read_message_id": NIL_ID,
                        "joined_at": joined_at,
                    }
                    for m in member_ids
                ],
            )

    async def remove_memberships(self, group_id: uuid.UUID, member_ids: list[uuid.UUID]) -> None:
        await self._execute(
            memberships.delete().where(
                memberships.c.group_id == group_id, memberships.c.member_id.in_(member_ids)
            )
        )

    async def get_membership(self, group_id: uuid.UUID, member_id: uuid.UUID) -> Membership | None:
        rows = await self._rows(
            memberships.select().where(
                memberships.c.group_id == group_id, memberships.c.member_id == member_id
            )
        )
        if not rows:
            return None
        row = rows[0]
        return Membership(row.group_id, row.member_id, row.last_read_message_id, row.joined_at)

    async def group_access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        reply_group = (
            sa.select(messages.c.group_id).where(messages.c.id == reply_to).scalar_subquery()
            if reply_to is not None
            else sa.null()
        )
        query = (
            sa.select(groups.c.workspace_id, memberships.c.member_id, reply_group.label("reply_group"))
            .select_from(
                groups.outerjoin(
                    memberships,
                    sa.and_(memberships.c.group_id == groups.c.id, memberships.c.member_id.in_(member_ids)),
                )
            )
            .where(groups.c.id == group_id)
        )
        rows = await self._rows(query)
        if not rows:
            return None
        return GroupAccess(
            workspace_id=rows[0].workspace_id,
            members=frozenset(r.member_id for r in rows if r.member_id is not None),
            reply_to_group=rows[0].reply_group,
        )

    async def memberships_of(self, member_id: uuid.UUID) -> list[Membership]:
        rows = await self._rows(memberships.select().where(memberships.c.member_id == member_id))
        return [Membership(r.group_id, r.member_id, r.last_read_message_id, r.joined_at) for r in rows]

    # -- messages -----------------------------------------------------------

    async def add_message(self, message: Message) -> None:
        insert = _dialect_insert(self._db)(messages).values(**_message_values(message))
        if message.request_id is None:
            await self._execute(insert)
            return
        # DO NOTHING rather than an IntegrityError, which would abort a PostgreSQL transaction.
        result = await self._execute(
            insert.on_conflict_do_nothing(index_elements=[messages.c.sender_id, messages.c.request_id])
        )
        if not result.rowcount:
            raise DuplicateRequest(message.request_id)

    async def find_message_by_request(self, sender_id: uuid.UUID, request_id: str) -> Message | None:
        rows = await self._rows(
            messages.select().where(messages.c.sender_id == sender_id, messages.c.request_id == request_id)
        )
        return _message(rows[0]) if rows else None

    async def get_message(self, message_id: uuid.UUID) -> Message | None:
        rows = await self._rows(messages.select().where(messages.c.id == message_id))
        return _message(rows[0]) if rows else None

    async def edit_message(self, message_id: uuid.UUID, content: str, edited_at: datetime) -> None:
        await self._execute(
            messages.update().where(messages.c.id == message_id).values(content=content, edited_at=edited_at)
        )

    async def list_messages(
        self, group_id: uuid.UUID, *, before: uuid.UUID | None, after: uuid.UUID | None, limit: int
    ) -> list[Message]:
        query = messages.select().where(messages.c.group_id == group_id).limit(limit)
        if before is not None:
            query = query.where(messages.c.id < before)
        if after is not None:
            query = query.where(messages.c.id > after)
        if after is not None and before is None:
            return [_message(r) for r in await self._rows(query.order_by(messages.c.id))]
        newest_first = [_message(r) for r in await self._rows(query.order_by(messages.c.id.desc()))]
        return newest_first[::-1]

    async def last_messages(self, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, Message]:
        if not group_ids:
            return {}
        # One index probe per group: max(id) of a group is the last entry of its index range.
        newest = (
            sa.select(messages.c.id)
            .where(messages.c.group_id == groups.c.id)
            .order_by(messages.c.id.desc())
            .limit(1)
            .correlate(groups)
            .scalar_subquery()
        )
        ids = [
            row.last_id
            for row in await self._rows(sa.select(newest.label("last_id")).where(groups.c.id.in_(group_ids)))
            if row.last_id is not None
        ]
        if not ids:
            return {}
        rows = await self._rows(messages.select().where(messages.c.id.in_(ids)))
        return {r.group_id: _message(r) for r in rows}

    # -- read state ---------------------------------------------------------

    async def advance_read(self, group_id: uuid.UUID, member_id: uuid.UUID, up_to: uuid.UUID) -> bool:
        result = await self._execute(
            memberships.update()
            .where(
                memberships.c.group_id == group_id,
                memberships.c.member_id == member_id,
                memberships.c.last_read_message_id < up_to,
            )
            .values(last_read_message_id=up_to)
        )
        return bool(result.rowcount)

    def _unread_join(self, member_id: uuid.UUID) -> sa.Select[Any]:
        return (
            sa.select(messages)
            .join(
                memberships,
                sa.and_(
                    memberships.c.group_id == messages.c.group_id,
                    messages.c.id > memberships.c.last_read_message_id,
                ),
            )
            .where(memberships.c.member_id == member_id, messages.c.sender_id != member_id)
        )

    async def unread_counts(self, member_id: uuid.UUID, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
        if not group_ids:
            return {}
        unread = self._unread_join(member_id).where(memberships.c.group_id.in_(group_ids)).subquery()
        rows = await self._rows(
            sa.select(unread.c.group_id, sa.func.count().label("unread")).group_by(unread.c.group_id)
        )
        return {row.group_id: int(row.unread) for row in rows}

    async def unread_messages(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        query = self._unread_join(member_id)
        rows = await self._rows(query.order_by(messages.c.id).limit(limit))
        found = [_message(r) for r in rows]
        if len(found) < limit:
            return found, len(found)
        total = (await self._execute(sa.select(sa.func.count()).select_from(query.subquery()))).scalar_one()
        return found, int(total)

    # -- events and idempotency -----------------------------------------------

    async def append_event(self, workspace_id: uuid.UUID, event: Event, at: datetime) -> int:
        # The counter row lock is held until commit, so sequence order is commit order.
        kind, payload = codec.encode_event(event)
        if not self._db.is_sqlite:
            # One round trip: take the next number and insert the event with it.
            taken = (
                event_counters.update()
                .where(event_counters.c.workspace_id == workspace_id)
                .values(last_sequence=event_counters.c.last_sequence + 1)
                .returning(event_counters.c.last_sequence)
                .cte("taken")
            )
            values = sa.select(
                sa.literal(workspace_id, sa.Uuid),
                taken.c.last_sequence,
                sa.literal(event_group_id(event), sa.Uuid),
                sa.literal(kind),
                sa.literal(payload, sa.Text),
                sa.literal(at, UtcDateTime),
            )
            columns = ["workspace_id", "sequence", "group_id", "kind", "payload", "recorded_at"]
            statement = (
                events.insert().from_select(columns, values).returning(events.c.sequence).add_cte(taken)
            )
            return int((await self._execute(statement)).scalar_one())
        sequence = (
            await self._execute(
                event_counters.update()
                .where(event_counters.c.workspace_id == workspace_id)
                .values(last_sequence=event_counters.c.last_sequence + 1)
                .returning(event_counters.c.last_sequence)
            )
        ).scalar_one()
        await self._execute(
            events.insert().values(
                workspace_id=workspace_id,
                sequence=sequence,
                group_id=event_group_id(event),
                kind=kind,
                payload=payload,
                recorded_at=at,
            )
        )
        return int(sequence)

    async def read_events(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]:
        query = (
            events.select()
            .where(events.c.workspace_id == workspace_id, events.c.sequence > after)
            .order_by(events.c.sequence)
            .limit(limit)
        )
        if up_to is not None:
            query = query.where(events.c.sequence <= up_to)
        return [self._recorded(r) for r in await self._rows(query)]

    @staticmethod
    def _recorded(row: sa.Row[Any]) -> RecordedEvent:
        return RecordedEvent(
            workspace_id=row.workspace_id,
            sequence=int(row.sequence),
            recorded_at=row.recorded_at,
            event=codec.decode_event(row.kind, row.payload),
            group_id=row.group_id,
        )

    async def group_changes(self, workspace_id: uuid.UUID, *, after: int) -> list[RecordedEvent]:
        query = (
            events.select()
            .where(
                events.c.workspace_id == workspace_id,
                events.c.sequence > after,
                events.c.kind == codec.KINDS[GroupChanged],
            )
            .order_by(events.c.sequence)
        )
        return [self._recorded(r) for r in await self._rows(query)]

    async def last_event_sequence(self, workspace_id: uuid.UUID) -> int:
        value = (
            await self._execute(
                sa.select(event_counters.c.last_sequence).where(event_counters.c.workspace_id == workspace_id)
            )
        ).scalar_one_or_none()
        return int(value or 0)

    async def find_request(self, scope: uuid.UUID, request_id: str) -> tuple[str, uuid.UUID] | None:
        rows = await self._rows(
            sa.select(requests.c.fingerprint, requests.c.resource_id).where(
                requests.c.scope == scope, requests.c.request_id == request_id
            )
        )
        return (rows[0].fingerprint, rows[0].resource_id) if rows else None

    async def remember_request(
        self, scope: uuid.UUID, request_id: str, fingerprint: str, resource_id: uuid.UUID
    ) -> None:
        try:
            await self._execute(
                requests.insert().values(
                    scope=scope,
                    request_id=request_id,
                    fingerprint=fingerprint,
                    resource_id=resource_id,
                    created_at=datetime.now(UTC),
                )
            )
        except sa.exc.IntegrityError as error:
            raise DuplicateRequest(request_id) from error
