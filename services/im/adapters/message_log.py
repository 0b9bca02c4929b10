"""The message log: the path every message takes, written for speed.

Messages sent at the same time are appended together (`NaturalBatcher`):
one round trip and one commit serve many senders. On PostgreSQL a batch is
one statement sent straight through asyncpg (from the engine's pool), since
building SQLAlchemy statements would cost several times the CPU the database
needs to run them. On SQLite a batch is one transaction run in one go on the
database's dedicated writer connection, instead of a thread hop per query
(see `services.common.sql.SqliteWorker`).
Both store exactly what `TransactionalMessageLog` (the reference, used by
the tests' fakes) stores, in the formats the SQLAlchemy tables read back.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from datetime import datetime
from typing import Any

import asyncpg

from services.common.batching import NaturalBatcher
from services.common.sql import database_unavailable, sqlite_time
from services.im.adapters import codec
from services.im.adapters.sql import Database
from services.im.adapters.tables import SCHEMA
from services.im.domain.model import Message, MessageCreated
from services.im.service_layer.ports import GroupAccess, MessageLog, TransactionalMessageLog


def open_message_log(database: Database) -> MessageLog:
    """The fastest message log for the database's backend."""
    if database.is_sqlite:
        return SqliteMessageLog(database)
    return PostgresMessageLog(database)


class SqliteMessageLog(MessageLog):
    """`MessageLog` on SQLite: a batch is one transaction on the database's writer connection.

    The connection lives in one worker thread, so a batch costs one thread
    hop instead of one per query. Writers of this process take turns through
    the database's write lock; other processes wait on SQLite's own.
    """

    def __init__(self, database: Database, *, max_batch: int = 256) -> None:
        self._db = database
        self._transactional = TransactionalMessageLog(database.transaction)
        self._batcher: NaturalBatcher[tuple[Message, datetime], int | None] = NaturalBatcher(
            self._append_batch, max_batch=max_batch, not_about_items=database_unavailable
        )

    async def access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        return await self._transactional.access(group_id, member_ids, reply_to)

    async def append(self, message: Message, at: datetime) -> int | None:
        return await self._batcher.submit((message, at))

    async def _append_batch(self, batch: list[tuple[Message, datetime]]) -> list[int | None]:
        rows = [
            (message, at, codec.encode_event(MessageCreated(message=message))[1]) for message, at in batch
        ]
        return await self._db.sqlite.write(lambda conn: self._store(conn, rows))

    @staticmethod
    def _store(conn: sqlite3.Connection, rows: list[tuple[Message, datetime, str]]) -> list[int | None]:
        stored: dict[str, list[int]] = {}  # workspace -> indexes of stored rows, in arrival order
        for index, (message, _, _) in enumerate(rows):
            group, sender = message.group_id.hex, message.sender_id.hex
            mentioned = json.dumps([m.hex for m in message.mentions])
            reply_to = message.reply_to.hex if message.reply_to is not None else None
            (valid,) = conn.execute(
                _SQLITE_VALID, (group, message.workspace_id.hex, sender, mentioned, reply_to)
            ).fetchone()
            if not valid:
                continue
            inserted = conn.execute(
                _SQLITE_INSERT_MESSAGE,
                (
                    message.id.hex,
                    message.workspace_id.hex,
                    group,
                    sender,
                    message.content_type.value,
                    message.content,
                    json.dumps([str(m) for m in message.mentions]),
                    reply_to,
                    json.dumps(message.metadata, ensure_ascii=False),
                    sqlite_time(message.sent_at),
                    message.request_id,
                    message.request_hash,
                ),
            ).rowcount
            if inserted:
                stored.setdefault(message.workspace_id.hex, []).append(index)
        results: list[int | None] = [None] * len(rows)
        for workspace, indexes in stored.items():
            (last,) = conn.execute(_SQLITE_TAKE_SEQUENCES, (len(indexes), workspace)).fetchone()
            for place, index in enumerate(indexes, start=last - len(indexes) + 1):
                message, at, payload = rows[index]
                conn.execute(
                    _SQLITE_INSERT_EVENT,
                    (workspace, place, message.group_id.hex, _MESSAGE_CREATED, payload, sqlite_time(at)),
                )
                results[index] = place
        return results

    async def aclose(self) -> None:
        # The connection is the database's: it closes it.
        await self._batcher.aclose()


_MESSAGE_CREATED = codec.KINDS[MessageCreated]

# Ids are stored as SQLAlchemy's Uuid stores them on SQLite: 32 hex digits.
_SQLITE_VALID = """
SELECT EXISTS (SELECT 1 FROM groups WHERE id = ?1 AND workspace_id = ?2)
   AND EXISTS (SELECT 1 FROM memberships WHERE group_id = ?1 AND member_id = ?3)
   AND (SELECT count(*) FROM memberships
        WHERE group_id = ?1 AND member_id IN (SELECT value FROM json_each(?4))) = json_array_length(?4)
   AND (?5 IS NULL OR EXISTS (SELECT 1 FROM messages WHERE id = ?5 AND group_id = ?1))
"""
_SQLITE_INSERT_MESSAGE = """
INSERT INTO messages (id, workspace_id, group_id, sender_id, content_type, content, mentions,
                      reply_to, metadata, sent_at, request_id, request_hash)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (sender_id, request_id) DO NOTHING
"""
_SQLITE_TAKE_SEQUENCES = """
UPDATE event_counters SET last_sequence = last_sequence + ? WHERE workspace_id = ? RETURNING last_sequence
"""
_SQLITE_INSERT_EVENT = """
INSERT INTO events (workspace_id, sequence, group_id, kind, payload, recorded_at) VALUES (?, ?, ?, ?, ?, ?)
"""


class PostgresMessageLog(MessageLog):
    """`MessageLog` on PostgreSQL: a batch is one statement that commits on its own."""

    # Tries of a batch that PostgreSQL aborted to break a deadlock with another replica's.
    DEADLOCK_TRIES = 3

    def __init__(self, database: Database, *, max_batch: int = 256) -> None:
        self._db = database
        self._batcher: NaturalBatcher[tuple[Message, datetime], int | None] = NaturalBatcher(
            self._append_batch, max_batch=max_batch, not_about_items=database_unavailable
        )

    async def access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        async def fetch() -> list[Any]:
            async with self._db.driver_connection() as conn:
                return list(await conn.fetch(_ACCESS_SQL, group_id, member_ids, reply_to))

        rows = await self._db.retry_read(fetch)
        if not rows:
            return None
        return GroupAccess(
            workspace_id=rows[0]["workspace_id"],
            members=frozenset(r["member_id"] for r in rows if r["member_id"] is not None),
            reply_to_group=rows[0]["reply_group"],
        )

    async def append(self, message: Message, at: datetime) -> int | None:
        return await self._batcher.submit((message, at))

    async def _append_batch(self, batch: list[tuple[Message, datetime]]) -> list[int | None]:
        columns: list[list[Any]] = [[] for _ in range(14)]
        for message, at in batch:
            _, payload = codec.encode_event(MessageCreated(message=message))
            row = (
                message.id,
                message.workspace_id,
                message.group_id,
                message.sender_id,
                message.content_type.value,
                message.content,
                json.dumps([str(m) for m in message.mentions]),
                message.reply_to,
                json.dumps(message.metadata, ensure_ascii=False),
                message.sent_at,
                message.request_id,
                message.request_hash,
                payload,
                at,
            )
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        for attempt in range(1, self.DEADLOCK_TRIES + 1):
            try:
                async with self._db.driver_connection() as conn:
                    rows = await conn.fetch(_APPEND_SQL, *columns)
                break
            except asyncpg.exceptions.DeadlockDetectedError:
                if attempt == self.DEADLOCK_TRIES:
                    raise
        sequences = {row["id"]: int(row["sequence"]) for row in rows}
        return [sequences.get(message.id) for message, _ in batch]

    async def aclose(self) -> None:
        await self._batcher.aclose()


_ACCESS_SQL = f"""
SELECT g.workspace_id, m.member_id,
       (SELECT r.group_id FROM {SCHEMA}.messages r WHERE r.id = $3::uuid) AS reply_group
FROM {SCHEMA}.groups g
LEFT JOIN {SCHEMA}.memberships m ON m.group_id = g.id AND m.member_id = ANY($2::uuid[])
WHERE g.id = $1::uuid
"""

# Appends a batch of messages in one statement. A message is stored only if
# its request is valid (its group is in its workspace, the sender and the
# mentioned are members, the replied-to message is in the group) and its
# request_id is new. Each workspace's event counter is locked (in workspace
# order, to keep replicas' batches from deadlocking; should PostgreSQL still
# break one, the batch is retried), advanced by the number of stored messages,
# and their events get the numbers in arrival order. The statement commits on
# its own. Returns the stored messages' ids and sequences.
_APPEND_SQL = f"""
WITH input AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::varchar[], $6::text[],
                         $7::text[], $8::uuid[], $9::text[], $10::timestamptz[], $11::varchar[],
                         $12::varchar[], $13::text[], $14::timestamptz[])
        WITH ORDINALITY AS t(id, workspace_id, group_id, sender_id, content_type, content, mentions,
                             reply_to, metadata, sent_at, request_id, request_hash, payload,
                             recorded_at, ord)
), valid AS (
    SELECT i.* FROM input i
    WHERE EXISTS (SELECT 1 FROM {SCHEMA}.groups g WHERE g.id = i.group_id AND g.workspace_id = i.workspace_id)
      AND EXISTS (SELECT 1 FROM {SCHEMA}.memberships m
                  WHERE m.group_id = i.group_id AND m.member_id = i.sender_id)
      AND NOT EXISTS (SELECT 1 FROM json_array_elements_text(i.mentions::json) AS mentioned(id)
                      WHERE NOT EXISTS (SELECT 1 FROM {SCHEMA}.memberships m
                                        WHERE m.group_id = i.group_id AND m.member_id = mentioned.id::uuid))
      AND (i.reply_to IS NULL
           OR EXISTS (SELECT 1 FROM {SCHEMA}.messages r WHERE r.id = i.reply_to AND r.group_id = i.group_id))
), stored AS (
    INSERT INTO {SCHEMA}.messages (id, workspace_id, group_id, sender_id, content_type, content,
                                   mentions, reply_to, metadata, sent_at, request_id, request_hash)
    SELECT id, workspace_id, group_id, sender_id, content_type, content,
           mentions::json, reply_to, metadata::json, sent_at, request_id, request_hash
    FROM valid ORDER BY ord
    ON CONFLICT (sender_id, request_id) DO NOTHING
    RETURNING id
), numbered AS (
    SELECT v.id, v.workspace_id, v.group_id, v.payload, v.recorded_at,
           row_number() OVER (PARTITION BY v.workspace_id ORDER BY v.ord) AS place,
           count(*) OVER (PARTITION BY v.workspace_id) AS stored_count
    FROM valid v JOIN stored s ON s.id = v.id
), locked AS (
    SELECT c.workspace_id FROM {SCHEMA}.event_counters c
    WHERE c.workspace_id IN (SELECT workspace_id FROM numbered)
    ORDER BY c.workspace_id
    FOR UPDATE
), taken AS (
    UPDATE {SCHEMA}.event_counters c
    SET last_sequence = c.last_sequence + n.stored_count
    FROM (SELECT workspace_id, max(stored_count) AS stored_count FROM numbered GROUP BY workspace_id) n
    WHERE c.workspace_id = n.workspace_id AND c.workspace_id IN (SELECT workspace_id FROM locked)
    RETURNING c.workspace_id, c.last_sequence
), recorded AS (
    INSERT INTO {SCHEMA}.events (workspace_id, sequence, group_id, kind, payload, recorded_at)
    SELECT n.workspace_id, t.last_sequence - n.stored_count + n.place, n.group_id,
           '{codec.KINDS[MessageCreated]}', n.payload, n.recorded_at
    FROM numbered n JOIN taken t ON t.workspace_id = n.workspace_id
    RETURNING sequence
)
SELECT n.id, t.last_sequence - n.stored_count + n.place AS sequence
FROM numbered n JOIN taken t ON t.workspace_id = n.workspace_id
"""
