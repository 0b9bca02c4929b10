"""The read path: what an agent's wake goes through, written for speed.

An agent is woken by an event (`EventLog.read`, once per wake-up of its
workspace's tail), reads its unread messages (`Inbox.unread`) and marks what
it read (`Inbox.mark_read`). Like the message log (`message_log`), each call
is one thread hop on SQLite (a whole transaction run in one go on the
database's dedicated connections) and one statement sent straight through
asyncpg on PostgreSQL, instead of a SQLAlchemy statement, a thread hop or a
round trip per query. They read and write exactly what `TransactionalInbox`
and `TransactionalEventLog` (the references, used by the tests' fakes) do.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from datetime import datetime
from typing import Any

from services.common.sql import sqlite_id, sqlite_time, sqlite_time_from
from services.im.adapters import codec
from services.im.adapters.sql import Database
from services.im.adapters.tables import SCHEMA
from services.im.domain.model import (
    ContentType,
    Member,
    Message,
    ReadState,
    ReadUpdated,
    RecordedEvent,
)
from services.im.service_layer.ports import EventLog, Inbox, MarkedRead, ReadOutcome

# The largest event sequence number (a BIGINT): "no upper bound".
_NO_BOUND = 2**63 - 1
_READ_UPDATED = codec.KINDS[ReadUpdated]


class ReadPath(Inbox, EventLog):
    """Both read-path ports, on one database."""


def open_read_path(database: Database) -> ReadPath:
    """The fastest read path for the database's backend."""
    if database.is_sqlite:
        return SqliteReadPath(database)
    return PostgresReadPath(database)


def _outcome(visible: bool, is_member: bool, in_group: bool) -> ReadOutcome:
    if not visible:
        return ReadOutcome.NO_GROUP
    if not is_member:
        return ReadOutcome.NOT_A_MEMBER
    if not in_group:
        return ReadOutcome.NOT_IN_GROUP
    return ReadOutcome.DONE


# -- SQLite ---------------------------------------------------------------------------
# Ids are stored as SQLAlchemy's Uuid stores them on SQLite (32 hex digits),
# times as naive UTC text, JSON as text.

_MESSAGE_COLUMNS = """m.id, m.workspace_id, m.group_id, m.sender_id, m.content_type, m.content, m.mentions,
       m.reply_to, m.metadata, m.sent_at, m.edited_at, m.request_id, m.request_hash"""

_UNREAD_JOIN = """FROM messages m
JOIN memberships s ON s.group_id = m.group_id AND m.id > s.last_read_message_id
WHERE s.member_id = ?1 AND m.sender_id != ?1"""

_SQLITE_UNREAD = f"SELECT {_MESSAGE_COLUMNS}\n{_UNREAD_JOIN}\nORDER BY m.id LIMIT ?2"
_SQLITE_UNREAD_COUNT = f"SELECT count(*)\n{_UNREAD_JOIN}"

_SQLITE_EVENTS = """
SELECT sequence, group_id, kind, payload, recorded_at FROM events
WHERE workspace_id = ? AND sequence > ? AND sequence <= ?
ORDER BY sequence LIMIT ?
"""
_SQLITE_LAST_SEQUENCE = "SELECT last_sequence FROM event_counters WHERE workspace_id = ?"

_SQLITE_MARK_CHECK = """
SELECT g.workspace_id = ?4,
       EXISTS (SELECT 1 FROM memberships WHERE group_id = ?1 AND member_id = ?2),
       EXISTS (SELECT 1 FROM messages WHERE id = ?3 AND group_id = ?1)
FROM groups g WHERE g.id = ?1
"""
_SQLITE_ADVANCE = """
UPDATE memberships SET last_read_message_id = ?3
WHERE group_id = ?1 AND member_id = ?2 AND last_read_message_id < ?3
"""
_SQLITE_POSITION = """
SELECT s.last_read_message_id,
       (SELECT count(*) FROM messages m
        WHERE m.group_id = ?1 AND m.id > s.last_read_message_id AND m.sender_id != ?2)
FROM memberships s WHERE s.group_id = ?1 AND s.member_id = ?2
"""
_SQLITE_TAKE_SEQUENCE = """
UPDATE event_counters SET last_sequence = last_sequence + 1 WHERE workspace_id = ? RETURNING last_sequence
"""
_SQLITE_INSERT_EVENT = """
INSERT INTO events (workspace_id, sequence, group_id, kind, payload, recorded_at) VALUES (?, ?, ?, ?, ?, ?)
"""


def _sqlite_message(row: tuple[Any, ...]) -> Message:
    (id_, workspace, group, sender, kind, content, mentions, reply_to, metadata, sent_at, edited_at) = row[
        :11
    ]
    return Message(
        id=sqlite_id(id_),
        workspace_id=sqlite_id(workspace),
        group_id=sqlite_id(group),
        sender_id=sqlite_id(sender),
        content_type=ContentType(kind),
        content=content,
        mentions=tuple(uuid.UUID(m) for m in json.loads(mentions)),
        reply_to=sqlite_id(reply_to) if reply_to is not None else None,
        metadata=json.loads(metadata),
        sent_at=sqlite_time_from(sent_at),
        edited_at=sqlite_time_from(edited_at) if edited_at is not None else None,
        request_id=row[11],
        request_hash=row[12],
    )


class SqliteReadPath(ReadPath):
    """The read path on SQLite: each call one transaction in one thread hop.

    Reads run on the database's read-only connections; `mark_read` on its
    writer connection, in turn with the other writers of this process.
    """

    def __init__(self, database: Database) -> None:
        self._db = database

    async def unread(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        def work(conn: sqlite3.Connection) -> tuple[list[Message], int]:
            found = [_sqlite_message(r) for r in conn.execute(_SQLITE_UNREAD, (member_id.hex, limit))]
            if len(found) < limit:
                return found, len(found)
            (total,) = conn.execute(_SQLITE_UNREAD_COUNT, (member_id.hex,)).fetchone()
            return found, int(total)

        return await self._db.sqlite.read(work)

    async def mark_read(
        self, member: Member, group_id: uuid.UUID, up_to: uuid.UUID, at: datetime
    ) -> MarkedRead:
        group, member_hex, up_to_hex = group_id.hex, member.id.hex, up_to.hex

        def work(conn: sqlite3.Connection) -> MarkedRead:
            checked = conn.execute(
                _SQLITE_MARK_CHECK, (group, member_hex, up_to_hex, member.workspace_id.hex)
            ).fetchone()
            outcome = _outcome(*map(bool, checked)) if checked is not None else ReadOutcome.NO_GROUP
            if outcome is not ReadOutcome.DONE:
                return MarkedRead(outcome)
            moved = conn.execute(_SQLITE_ADVANCE, (group, member_hex, up_to_hex)).rowcount > 0
            position, unread = conn.execute(_SQLITE_POSITION, (group, member_hex)).fetchone()
            state = ReadState(
                group_id=group_id,
                member_id=member.id,
                last_read_message_id=sqlite_id(position),
                unread_count=int(unread),
            )
            if not moved:
                return MarkedRead(ReadOutcome.DONE, state)
            workspace = member.workspace_id.hex
            (sequence,) = conn.execute(_SQLITE_TAKE_SEQUENCE, (workspace,)).fetchone()
            payload = codec.encode_event(ReadUpdated(read_state=state))[1]
            conn.execute(
                _SQLITE_INSERT_EVENT, (workspace, sequence, group, _READ_UPDATED, payload, sqlite_time(at))
            )
            return MarkedRead(ReadOutcome.DONE, state, int(sequence))

        return await self._db.sqlite.write(work)

    async def read(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]:
        bound = _NO_BOUND if up_to is None else up_to

        def work(conn: sqlite3.Connection) -> list[RecordedEvent]:
            rows = conn.execute(_SQLITE_EVENTS, (workspace_id.hex, after, bound, limit)).fetchall()
            return [
                RecordedEvent(
                    workspace_id=workspace_id,
                    sequence=int(sequence),
                    recorded_at=sqlite_time_from(recorded_at),
                    event=codec.decode_event(kind, payload),
                    group_id=sqlite_id(group) if group is not None else None,
                )
                for sequence, group, kind, payload, recorded_at in rows
            ]

        return await self._db.sqlite.read(work)

    async def last_sequence(self, workspace_id: uuid.UUID) -> int:
        def work(conn: sqlite3.Connection) -> int:
            row = conn.execute(_SQLITE_LAST_SEQUENCE, (workspace_id.hex,)).fetchone()
            return int(row[0]) if row is not None else 0

        return await self._db.sqlite.read(work)


# -- PostgreSQL -----------------------------------------------------------------------

_PG_UNREAD_JOIN = f"""FROM {SCHEMA}.messages m
JOIN {SCHEMA}.memberships s ON s.group_id = m.group_id AND m.id > s.last_read_message_id
WHERE s.member_id = $1::uuid AND m.sender_id <> $1::uuid"""

_PG_UNREAD = f"""
SELECT m.id, m.workspace_id, m.group_id, m.sender_id, m.content_type, m.content, m.mentions::text,
       m.reply_to, m.metadata::text, m.sent_at, m.edited_at, m.request_id, m.request_hash
{_PG_UNREAD_JOIN}
ORDER BY m.id LIMIT $2
"""
_PG_UNREAD_COUNT = f"SELECT count(*)\n{_PG_UNREAD_JOIN}"

_PG_EVENTS = f"""
SELECT sequence, group_id, kind, payload, recorded_at FROM {SCHEMA}.events
WHERE workspace_id = $1::uuid AND sequence > $2 AND sequence <= $3
ORDER BY sequence LIMIT $4
"""
_PG_LAST_SEQUENCE = f"SELECT last_sequence FROM {SCHEMA}.event_counters WHERE workspace_id = $1::uuid"

# MarkRead in one statement that commits on its own. The membership row is
# locked (FOR UPDATE returns its newest committed version, so a concurrent
# MarkRead is waited for and seen), moved forward if that is forward, and the
# read state is taken after the move. Only if it moved is the workspace's
# event counter advanced (locked until the statement commits, so sequence
# order is commit order) and the ReadUpdated event recorded, its payload
# written exactly as `codec.encode_event` writes it. No row: no such group.
_PG_MARK_READ = f"""
WITH target AS (
    SELECT g.workspace_id = $4::uuid AS visible,
           EXISTS (SELECT 1 FROM {SCHEMA}.memberships s
                   WHERE s.group_id = $1::uuid AND s.member_id = $2::uuid) AS is_member,
           EXISTS (SELECT 1 FROM {SCHEMA}.messages m
                   WHERE m.id = $3::uuid AND m.group_id = $1::uuid) AS in_group
    FROM {SCHEMA}.groups g WHERE g.id = $1::uuid
), locked AS (
    SELECT s.last_read_message_id FROM {SCHEMA}.memberships s
    WHERE s.group_id = $1::uuid AND s.member_id = $2::uuid
      AND EXISTS (SELECT 1 FROM target t WHERE t.visible AND t.in_group)
    FOR UPDATE
), moved AS (
    UPDATE {SCHEMA}.memberships s SET last_read_message_id = $3::uuid
    FROM locked l
    WHERE s.group_id = $1::uuid AND s.member_id = $2::uuid AND l.last_read_message_id < $3::uuid
    RETURNING s.last_read_message_id
), counted AS (
    SELECT p.last_read,
           (SELECT count(*) FROM {SCHEMA}.messages m
            WHERE m.group_id = $1::uuid AND m.id > p.last_read AND m.sender_id <> $2::uuid) AS unread
    FROM (SELECT coalesce((SELECT last_read_message_id FROM moved),
                          (SELECT last_read_message_id FROM locked)) AS last_read) p
), taken AS (
    UPDATE {SCHEMA}.event_counters c SET last_sequence = c.last_sequence + 1
    WHERE c.workspace_id = $4::uuid AND EXISTS (SELECT 1 FROM moved)
    RETURNING c.last_sequence
), recorded AS (
    INSERT INTO {SCHEMA}.events (workspace_id, sequence, group_id, kind, payload, recorded_at)
    SELECT $4::uuid, t.last_sequence, $1::uuid, '{_READ_UPDATED}',
           '{{"group_id":"' || $1::uuid::text || '","member_id":"' || $2::uuid::text
           || '","last_read_message_id":"' || c.last_read::text || '","unread_count":' || c.unread || '}}',
           $5::timestamptz
    FROM taken t, counted c
    RETURNING sequence
)
SELECT t.visible, t.is_member, t.in_group, c.last_read, c.unread, (SELECT sequence FROM recorded) AS sequence
FROM target t, counted c
"""


def _uuid(value: uuid.UUID) -> uuid.UUID:
    """A plain `uuid.UUID` (asyncpg returns its own subclass)."""
    return value if type(value) is uuid.UUID else uuid.UUID(bytes=value.bytes)


def _pg_message(row: Any) -> Message:
    reply_to, edited_at = row[7], row[10]
    return Message(
        id=_uuid(row[0]),
        workspace_id=_uuid(row[1]),
        group_id=_uuid(row[2]),
        sender_id=_uuid(row[3]),
        content_type=ContentType(row[4]),
        content=row[5],
        mentions=tuple(uuid.UUID(m) for m in json.loads(row[6])),
        reply_to=_uuid(reply_to) if reply_to is not None else None,
        metadata=json.loads(row[8]),
        sent_at=row[9],
        edited_at=edited_at,
        request_id=row[11],
        request_hash=row[12],
    )


class PostgresReadPath(ReadPath):
    """The read path on PostgreSQL: each call one statement that commits on its own.

    (GetAllUnread adds a count only when the page is full.)
    """

    def __init__(self, database: Database) -> None:
        self._db = database

    async def unread(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        async def read() -> tuple[list[Message], int]:
            async with self._db.driver_connection() as conn:
                found = [_pg_message(r) for r in await conn.fetch(_PG_UNREAD, member_id, limit)]
                if len(found) < limit:
                    return found, len(found)
                total = await conn.fetchval(_PG_UNREAD_COUNT, member_id)
            return found, int(total)

        return await self._db.retry_read(read)

    async def mark_read(
        self, member: Member, group_id: uuid.UUID, up_to: uuid.UUID, at: datetime
    ) -> MarkedRead:
        async with self._db.driver_connection() as conn:
            row = await conn.fetchrow(_PG_MARK_READ, group_id, member.id, up_to, member.workspace_id, at)
        if row is None:
            return MarkedRead(ReadOutcome.NO_GROUP)
        outcome = _outcome(row["visible"], row["is_member"], row["in_group"])
        if outcome is not ReadOutcome.DONE:
            return MarkedRead(outcome)
        state = ReadState(
            group_id=group_id,
            member_id=member.id,
            last_read_message_id=_uuid(row["last_read"]),
            unread_count=int(row["unread"]),
        )
        sequence = row["sequence"]
        return MarkedRead(ReadOutcome.DONE, state, int(sequence) if sequence is not None else None)

    async def read(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]:
        bound = _NO_BOUND if up_to is None else up_to

        async def fetch() -> list[Any]:
            async with self._db.driver_connection() as conn:
                return list(await conn.fetch(_PG_EVENTS, workspace_id, after, bound, limit))

        rows = await self._db.retry_read(fetch)
        return [
            RecordedEvent(
                workspace_id=workspace_id,
                sequence=int(sequence),
                recorded_at=recorded_at,
                event=codec.decode_event(kind, payload),
                group_id=_uuid(group) if group is not None else None,
            )
            for sequence, group, kind, payload, recorded_at in rows
        ]

    async def last_sequence(self, workspace_id: uuid.UUID) -> int:
        async def fetch() -> Any:
            async with self._db.driver_connection() as conn:
                return await conn.fetchval(_PG_LAST_SEQUENCE, workspace_id)

        return int(await self._db.retry_read(fetch) or 0)
