"""The runners' writes, made for speed: runs, steps, agents' progress and
the task queue's changes.

Every runner writes at every step. Through SQLAlchemy's async engine a
three-statement transaction took about 4 ms on SQLite (a thread hop per
statement, and statement building) for a small fraction of that in the
database. Here the writes that runners make at the same time go together
(natural batching): on SQLite as one transaction on a dedicated connection in
a worker thread (one hop), on PostgreSQL as one statement through asyncpg
(one round trip, committing on its own). They store exactly what the
SQLAlchemy tables of `tables.py` read back.

A write whose step is already stored (another writer of that agent got
there first) is refused as a whole with `DuplicateStep`, one whose task is no
longer in an expected status with `TaskMoved`, one whose new task's request
id is taken with `TaskRequestTaken`, one whose fence is no longer its shard's
lease (another replica took the shard) with `LeaseLost`; the others in its
batch are unaffected. The fence is checked in the write's own transaction
with the lease row locked FOR SHARE (see `adapters.leases.check_fence`), so a
take of the shard either waits for the write or refuses it: never both.
"""

from __future__ import annotations

import abc
import enum
import json
import sqlite3
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.common.audit import AuditRecord
from services.common.audit_sql import record_values
from services.common.batching import NaturalBatcher
from services.common.sql import SqlDatabase, SqliteWorker, database_unavailable, sqlite_time
from services.runtime.adapters.tables import SCHEMA
from services.runtime.domain.errors import DuplicateStep
from services.runtime.domain.model import Agent, Origin, Run, Step, Task, TaskStatus
from services.runtime.service_layer.leases import Fence, LeaseLost


class TaskMoved(Exception):
    """The task's stored status was not one the write expected (compare-and-set lost)."""


class TaskRequestTaken(Exception):
    """The agent has a task with the new task's request id already."""


class Refusal(enum.Enum):
    """Why a write was refused (as a whole)."""

    LEASE_LOST = "lease"
    STEP_TAKEN = "step"
    TASK_MOVED = "task"
    REQUEST_TAKEN = "request"


@dataclass(frozen=True, slots=True)
class Write:
    """What one runner writes at once; every part is optional.

    `read_marks` (group id -> message id, of `marks_of`'s agent) move that
    agent's read marks forward (never back), together with the steps the
    messages became.
    """

    new_run: Run | None = None
    ended_run: Run | None = None
    progress: Agent | None = None
    steps: Sequence[Step] = ()
    marks_of: uuid.UUID | None = None
    read_marks: Mapping[uuid.UUID, uuid.UUID] = field(default_factory=dict)
    # A new task (stored unless its agent has one with its request id) and
    # the audit record of its submission (stored with it, only if it is).
    new_task: Task | None = None
    audit: AuditRecord | None = None
    # A task's progress, stored if its stored status is one of `task_expected`.
    task: Task | None = None
    task_expected: Collection[TaskStatus] = ()
    # The lease of the agent's shard the writer holds; none where one
    # replica runs every agent (nobody else can write for them).
    fence: Fence | None = None


class Journal(abc.ABC):
    """Applies runners' writes, each atomically."""

    def __init__(self, *, max_batch: int = 256) -> None:
        self._batcher: NaturalBatcher[Write, Refusal | None] = NaturalBatcher(
            self._apply, max_batch=max_batch, not_about_items=database_unavailable
        )
        # Writes refused as their fence was no longer their shard's lease.
        self.refused_fenced_writes = 0

    async def write(self, write: Write) -> None:
        """Stores the write, all of it or (raising) none of it.

        Raises:
            DuplicateStep: one of its steps' (session, sequence) is taken.
            TaskMoved: its task's stored status is not one of `task_expected`.
            TaskRequestTaken: its new task's request id is taken.
            LeaseLost: its fence is no longer the lease of its shard.
        """
        refusal = await self._batcher.submit(write)
        if refusal is Refusal.LEASE_LOST:
            assert write.fence is not None
            self.refused_fenced_writes += 1
            raise LeaseLost.of(write.fence)
        if refusal is Refusal.STEP_TAKEN:
            sequences = [s.sequence for s in write.steps]
            raise DuplicateStep(f"steps {sequences} of session {write.steps[0].session_id} exist")
        if refusal is Refusal.TASK_MOVED:
            assert write.task is not None
            raise TaskMoved(f"task {write.task.id} is not {[s.value for s in write.task_expected]}")
        if refusal is Refusal.REQUEST_TAKEN:
            assert write.new_task is not None
            raise TaskRequestTaken(f"request_id {write.new_task.request_id!r} is taken")

    @abc.abstractmethod
    async def _apply(self, batch: list[Write]) -> list[Refusal | None]:
        """Stores a batch; per write, None if it was stored, else why not."""

    async def aclose(self) -> None:
        await self._batcher.aclose()


def _tool_calls(step: Step) -> str:
    calls = step.message.tool_calls
    return json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls])


def origin_record(origin: Origin | None) -> dict[str, object] | None:
    """An input step's origin as stored (JSON), or None."""
    if origin is None:
        return None
    ids = {
        "group_id": origin.group_id,
        "sender_id": origin.sender_id,
        "message_id": origin.message_id,
        "task_id": origin.task_id,
    }
    record: dict[str, object] = {name: str(value) for name, value in ids.items() if value is not None}
    if origin.group_name:
        record["group_name"] = origin.group_name
    if origin.sender_name:
        record["sender_name"] = origin.sender_name
    if origin.direct:
        record["direct"] = True
    return record


def origin_of_record(record: Mapping[str, Any] | None) -> Origin | None:
    """The origin `origin_record` stored."""
    if not record:
        return None

    def some_id(name: str) -> uuid.UUID | None:
        value = record.get(name)
        return uuid.UUID(value) if value else None

    return Origin(
        group_id=some_id("group_id"),
        group_name=str(record.get("group_name", "")),
        direct=bool(record.get("direct", False)),
        sender_id=some_id("sender_id"),
        sender_name=str(record.get("sender_name", "")),
        message_id=some_id("message_id"),
        task_id=some_id("task_id"),
    )


def _origin_json(step: Step) -> str | None:
    record = origin_record(step.origin)
    return json.dumps(record, ensure_ascii=False) if record is not None else None


def _trigger_ids(run: Run) -> str:
    return json.dumps([str(m) for m in run.trigger_message_ids])


def open_journal(database: SqlDatabase) -> Journal:
    """The journal for the database's backend."""
    if database.is_sqlite:
        return SqliteJournal(database)
    return PostgresJournal(database)


class SqliteJournal(Journal):
    """`Journal` on SQLite: a batch is one transaction, a savepoint per write."""

    def __init__(self, database: SqlDatabase, *, max_batch: int = 256) -> None:
        super().__init__(max_batch=max_batch)
        self._worker = SqliteWorker(database, name="runtime-sqlite-journal")

    async def _apply(self, batch: list[Write]) -> list[Refusal | None]:
        return await self._worker.write(lambda conn: [self._store(conn, w) for w in batch])

    @staticmethod
    def _store(conn: sqlite3.Connection, write: Write) -> Refusal | None:
        conn.execute("SAVEPOINT write")
        try:
            fence = write.fence
            if (
                fence is not None
                and not conn.execute(_SQLITE_FENCE, (fence.shard, fence.epoch, fence.replica)).fetchone()
            ):
                return Refusal.LEASE_LOST
            refusal = _store_task_parts(conn, write)
            if refusal is not None:
                conn.execute("ROLLBACK TO write")
                return refusal
            for step in write.steps:
                message, metrics = step.message, step.metrics
                inserted = conn.execute(
                    _SQLITE_INSERT_STEP,
                    (
                        step.id.hex,
                        step.agent_id.hex,
                        step.session_id.hex,
                        step.run_id.hex,
                        step.sequence,
                        message.role.value,
                        message.content,
                        message.reasoning,
                        _tool_calls(step),
                        message.tool_call_id,
                        message.name,
                        metrics.duration_ms,
                        metrics.first_token_ms,
                        metrics.input_tokens,
                        metrics.output_tokens,
                        metrics.cached_tokens,
                        metrics.model,
                        metrics.tool_duration_ms,
                        sqlite_time(step.created_at),
                        step.interrupted,
                        step.kind.value,
                        step.summary_through,
                        metrics.usage_estimated,
                        _origin_json(step),
                    ),
                ).rowcount
                if not inserted:
                    conn.execute("ROLLBACK TO write")
                    return Refusal.STEP_TAKEN
            if write.new_run is not None:
                run = write.new_run
                conn.execute(
                    _SQLITE_INSERT_RUN,
                    (
                        run.id.hex,
                        run.agent_id.hex,
                        run.session_id.hex,
                        run.status.value,
                        _trigger_ids(run),
                        sqlite_time(run.started_at),
                        run.iterations,
                        run.error,
                        sqlite_time(run.ended_at) if run.ended_at else None,
                        run.group_id.hex if run.group_id else None,
                    ),
                )
            if write.ended_run is not None:
                run = write.ended_run
                conn.execute(
                    _SQLITE_END_RUN,
                    (
                        run.status.value,
                        _trigger_ids(run),
                        run.iterations,
                        run.error,
                        sqlite_time(run.ended_at) if run.ended_at else None,
                        run.id.hex,
                    ),
                )
            if write.progress is not None:
                agent = write.progress
                conn.execute(
                    _SQLITE_PROGRESS,
                    (
                        agent.state.value,
                        agent.last_error,
                        agent.tokens_used,
                        agent.pause_pending,
                        agent.state_version,
                        agent.id.hex,
                    ),
                )
            if write.marks_of is not None:
                conn.executemany(
                    _SQLITE_MARK_READ,
                    [(write.marks_of.hex, g.hex, m.hex) for g, m in write.read_marks.items()],
                )
            return None
        finally:
            conn.execute("RELEASE write")

    async def aclose(self) -> None:
        await super().aclose()
        await self._worker.aclose()


def _store_task_parts(conn: sqlite3.Connection, write: Write) -> Refusal | None:
    """Stores a write's new task (with its audit record) and task progress."""
    if write.new_task is not None:
        task = write.new_task
        if not conn.execute(_SQLITE_INSERT_TASK, _sqlite_new_task(task)).rowcount:
            return Refusal.REQUEST_TAKEN
        if write.audit is not None:
            conn.execute(_SQLITE_INSERT_AUDIT, _sqlite_audit(write.audit))
    if write.task is not None:
        expected = [s.value for s in write.task_expected]
        statement = _SQLITE_MOVE_TASK.format(expected=", ".join("?" * len(expected)))
        values = (*_sqlite_progress(write.task), write.task.id.hex, *expected)
        if not conn.execute(statement, values).rowcount:
            return Refusal.TASK_MOVED
    return None


def _sqlite_progress(task: Task) -> tuple[Any, ...]:
    """The columns `update_task` replaces, in `_TASK_PROGRESS` order."""
    return (
        task.status.value,
        task.attempts,
        task.last_error,
        task.result,
        _sqlite_time_or_none(task.started_at),
        _sqlite_time_or_none(task.ended_at),
        _sqlite_time_or_none(task.retry_at),
        task.run_id.hex if task.run_id else None,
    )


def _sqlite_new_task(task: Task) -> tuple[Any, ...]:
    return (
        task.id.hex,
        task.agent_id.hex,
        task.session_id.hex,
        task.input,
        task.priority,
        task.request_id,
        sqlite_time(task.created_at),
        *_sqlite_progress(task),
    )


def _sqlite_audit(record: AuditRecord) -> tuple[Any, ...]:
    values = record_values(record)
    ids = {"id", "workspace_id", "actor_member_id"}
    times = {"at", "last_at"}
    row: list[Any] = []
    for name in _AUDIT_COLUMNS:
        value = values[name]
        if name in ids:
            value = value.hex if value is not None else None
        elif name in times:
            value = sqlite_time(value)
        elif name == "details":
            value = json.dumps(value)
        row.append(value)
    return tuple(row)


def _sqlite_time_or_none(value: datetime | None) -> str | None:
    return sqlite_time(value) if value is not None else None


_TASK_PROGRESS = (
    "status",
    "attempts",
    "last_error",
    "result",
    "started_at",
    "ended_at",
    "retry_at",
    "run_id",
)
_AUDIT_COLUMNS = (
    "id",
    "workspace_id",
    "actor_kind",
    "actor_member_id",
    "actor_service",
    "actor_key",
    "action",
    "target_kind",
    "target_id",
    "at",
    "last_at",
    "code",
    "reason",
    "request_id",
    "details",
    "count",
)
# The partial unique index uq_tasks_agent_request covers the tasks with a
# request id (written out: see `sql._has_request`).
_SQLITE_INSERT_TASK = f"""
INSERT INTO tasks (id, agent_id, session_id, input, priority, request_id, created_at,
                   {", ".join(_TASK_PROGRESS)})
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (agent_id, request_id) WHERE request_id != '' DO NOTHING
"""
_SQLITE_INSERT_AUDIT = f"""
INSERT INTO agent_audit_events ({", ".join(_AUDIT_COLUMNS)})
VALUES ({", ".join("?" * len(_AUDIT_COLUMNS))})
"""
_SQLITE_MOVE_TASK = (
    "UPDATE tasks SET "
    + ", ".join(f"{c} = ?" for c in _TASK_PROGRESS)
    + " WHERE id = ? AND status IN ({expected})"
)

# Ids as SQLAlchemy's Uuid stores them on SQLite (32 hex digits), times as
# `UtcDateTime` does, JSON as text.
_SQLITE_INSERT_STEP = """
INSERT INTO steps (id, agent_id, session_id, run_id, sequence, role, content, reasoning, tool_calls,
                   tool_call_id, name, duration_ms, first_token_ms, input_tokens, output_tokens,
                   cached_tokens, model, tool_duration_ms, created_at, interrupted, kind, summary_through,
                   usage_estimated, origin)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (session_id, sequence) DO NOTHING
"""
_SQLITE_INSERT_RUN = """
INSERT INTO runs (id, agent_id, session_id, status, trigger_message_ids, started_at, iterations, error,
                  ended_at, group_id)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
# Only one transaction writes at a time on SQLite: a take of the shard is
# ordered before or after the whole write.
_SQLITE_FENCE = "SELECT 1 FROM shard_leases WHERE shard = ? AND epoch = ? AND owner = ?"
_SQLITE_END_RUN = """
UPDATE runs SET status = ?, trigger_message_ids = ?, iterations = ?, error = ?, ended_at = ? WHERE id = ?
"""
_SQLITE_PROGRESS = (
    "UPDATE agents SET state = ?, last_error = ?, tokens_used = ?, pause_pending = ?, state_version = ?"
    " WHERE id = ?"
)
# 32 lower-case hex digits compare as the ids do (UUIDv7: by time).
_SQLITE_MARK_READ = """
INSERT INTO read_marks (agent_id, group_id, message_id) VALUES (?, ?, ?)
ON CONFLICT (agent_id, group_id) DO UPDATE SET message_id = excluded.message_id
WHERE excluded.message_id > read_marks.message_id
"""


class PostgresJournal(Journal):
    """`Journal` on PostgreSQL: a batch is one statement, through asyncpg."""

    def __init__(self, database: SqlDatabase, *, max_batch: int = 256) -> None:
        super().__init__(max_batch=max_batch)
        self._db = database

    async def _apply(self, batch: list[Write]) -> list[Refusal | None]:
        steps = [(index, step) for index, write in enumerate(batch) for step in write.steps]
        new_tasks = [(i, w.new_task) for i, w in enumerate(batch) if w.new_task is not None]
        audits = [
            (w.new_task.id, record_values(w.audit))
            for w in batch
            if w.new_task is not None and w.audit is not None
        ]
        moved = [(i, w.task, w.task_expected) for i, w in enumerate(batch) if w.task is not None]
        new_runs = [(i, w.new_run) for i, w in enumerate(batch) if w.new_run is not None]
        ended_runs = [(i, w.ended_run) for i, w in enumerate(batch) if w.ended_run is not None]
        progress = [(i, w.progress) for i, w in enumerate(batch) if w.progress is not None]
        fences = [(i, w.fence) for i, w in enumerate(batch) if w.fence is not None]
        marks = [
            (i, w.marks_of, group, message)
            for i, w in enumerate(batch)
            if w.marks_of is not None
            for group, message in w.read_marks.items()
        ]
        async with self._db.driver_connection() as conn:
            rows = await conn.fetch(
                _PG_APPLY,
                # $1-$19: steps
                [i for i, _ in steps],
                [s.id for _, s in steps],
                [s.agent_id for _, s in steps],
                [s.session_id for _, s in steps],
                [s.run_id for _, s in steps],
                [s.sequence for _, s in steps],
                [s.message.role.value for _, s in steps],
                [s.message.content for _, s in steps],
                [s.message.reasoning for _, s in steps],
                [_tool_calls(s) for _, s in steps],
                [s.message.tool_call_id for _, s in steps],
                [s.message.name for _, s in steps],
                [s.metrics.duration_ms for _, s in steps],
                [s.metrics.first_token_ms for _, s in steps],
                [s.metrics.input_tokens for _, s in steps],
                [s.metrics.output_tokens for _, s in steps],
                [s.metrics.cached_tokens for _, s in steps],
                [s.metrics.model for _, s in steps],
                [s.metrics.tool_duration_ms for _, s in steps],
                [s.created_at for _, s in steps],
                # $21-$30: new runs
                [i for i, _ in new_runs],
                [r.id for _, r in new_runs],
                [r.agent_id for _, r in new_runs],
                [r.session_id for _, r in new_runs],
                [r.status.value for _, r in new_runs],
                [_trigger_ids(r) for _, r in new_runs],
                [r.started_at for _, r in new_runs],
                [r.iterations for _, r in new_runs],
                [r.error for _, r in new_runs],
                [r.ended_at for _, r in new_runs],
                # $31-$37: ended runs
                [i for i, _ in ended_runs],
                [r.id for _, r in ended_runs],
                [r.status.value for _, r in ended_runs],
                [_trigger_ids(r) for _, r in ended_runs],
                [r.iterations for _, r in ended_runs],
                [r.error for _, r in ended_runs],
                [r.ended_at for _, r in ended_runs],
                # $38-$42: progress
                [i for i, _ in progress],
                [a.id for _, a in progress],
                [a.state.value for _, a in progress],
                [a.last_error for _, a in progress],
                [a.tokens_used for _, a in progress],
                # $43: steps again
                [s.interrupted for _, s in steps],
                # $44: progress again
                [a.pause_pending for _, a in progress],
                # $45-$48: read marks
                [i for i, *_ in marks],
                [agent for _, agent, _, _ in marks],
                [group for _, _, group, _ in marks],
                [message for *_, message in marks],
                # $49: new runs again
                [r.group_id for _, r in new_runs],
                # $50-$52: steps again
                [s.kind.value for _, s in steps],
                [s.summary_through for _, s in steps],
                [s.metrics.usage_estimated for _, s in steps],
                # $53: progress again
                [a.state_version for _, a in progress],
                # $54: steps again
                [_origin_json(s) for _, s in steps],
                # $55-$70: new tasks
                [i for i, _ in new_tasks],
                [t.id for _, t in new_tasks],
                [t.agent_id for _, t in new_tasks],
                [t.session_id for _, t in new_tasks],
                [t.input for _, t in new_tasks],
                [t.priority for _, t in new_tasks],
                [t.request_id for _, t in new_tasks],
                [t.created_at for _, t in new_tasks],
                [t.status.value for _, t in new_tasks],
                [t.attempts for _, t in new_tasks],
                [t.last_error for _, t in new_tasks],
                [t.result for _, t in new_tasks],
                [t.started_at for _, t in new_tasks],
                [t.ended_at for _, t in new_tasks],
                [t.retry_at for _, t in new_tasks],
                [t.run_id for _, t in new_tasks],
                # $71-$87: their audit records (by task id)
                [task_id for task_id, _ in audits],
                *[
                    [json.dumps(a[name]) if name == "details" else a[name] for _, a in audits]
                    for name in _AUDIT_COLUMNS
                ],
                # $88-$98: task progress
                [i for i, _, _ in moved],
                [t.id for _, t, _ in moved],
                [",".join(s.value for s in expected) for _, _, expected in moved],
                [t.status.value for _, t, _ in moved],
                [t.attempts for _, t, _ in moved],
                [t.last_error for _, t, _ in moved],
                [t.result for _, t, _ in moved],
                [t.started_at for _, t, _ in moved],
                [t.ended_at for _, t, _ in moved],
                [t.retry_at for _, t, _ in moved],
                [t.run_id for _, t, _ in moved],
                # $99-$102: fences
                [i for i, _ in fences],
                [f.shard for _, f in fences],
                [f.epoch for _, f in fences],
                [f.replica for _, f in fences],
            )
        refused = {int(row["w"]): Refusal(row["why"]) for row in rows}
        return [refused.get(index) for index in range(len(batch))]


# One statement stores a batch. A write with a step whose (session, sequence)
# is taken, a new task whose request id is taken, a task not in an expected
# status or a fence that is not its shard's lease any more is refused whole:
# every part is filtered on the refused writes. The lease rows of the fences
# are locked FOR SHARE: a take of one (an UPDATE) waits for this statement's
# commit, and one that committed first is seen with its new epoch (PostgreSQL
# checks a locked row's newest version against the join), so it refuses.
# (A step inserted concurrently between the check and the insert is still
# kept out by ON CONFLICT and its write reported refused, but that write's
# other parts then stand: only two runtimes running one agent get there.)
_PG_APPLY = f"""
WITH
new_steps AS (
    SELECT * FROM unnest($1::int[], $2::uuid[], $3::uuid[], $4::uuid[], $5::uuid[], $6::bigint[],
                         $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[],
                         $13::float8[], $14::float8[], $15::bigint[], $16::bigint[], $17::bigint[],
                         $18::text[], $19::float8[], $20::timestamptz[], $43::bool[], $50::text[],
                         $51::bigint[], $52::bool[], $54::text[])
        AS s(w, id, agent_id, session_id, run_id, sequence, role, content, reasoning, tool_calls,
             tool_call_id, name, duration_ms, first_token_ms, input_tokens, output_tokens,
             cached_tokens, model, tool_duration_ms, created_at, interrupted, kind, summary_through,
             usage_estimated, origin)
),
new_tasks AS (
    SELECT * FROM unnest($55::int[], $56::uuid[], $57::uuid[], $58::uuid[], $59::text[], $60::int[],
                         $61::text[], $62::timestamptz[], $63::text[], $64::int[], $65::text[], $66::text[],
                         $67::timestamptz[], $68::timestamptz[], $69::timestamptz[], $70::uuid[])
        AS t(w, id, agent_id, session_id, input, priority, request_id, created_at, status, attempts,
             last_error, result, started_at, ended_at, retry_at, run_id)
),
moves AS (
    SELECT * FROM unnest($88::int[], $89::uuid[], $90::text[], $91::text[], $92::int[], $93::text[],
                         $94::text[], $95::timestamptz[], $96::timestamptz[], $97::timestamptz[], $98::uuid[])
        AS m(w, id, expected, status, attempts, last_error, result, started_at, ended_at, retry_at, run_id)
),
fences AS (
    SELECT * FROM unnest($99::int[], $100::int[], $101::bigint[], $102::text[]) AS f(w, shard, epoch, owner)
),
held AS (
    SELECT l.shard, l.epoch, l.owner FROM {SCHEMA}.shard_leases l
    JOIN fences f ON l.shard = f.shard AND l.epoch = f.epoch AND l.owner = f.owner
    FOR SHARE OF l
),
refused_why AS (
    SELECT f.w, 'lease' AS why FROM fences f
    WHERE (f.shard, f.epoch, f.owner) NOT IN (SELECT shard, epoch, owner FROM held)
    UNION
    SELECT s.w, 'step' FROM new_steps s
    JOIN {SCHEMA}.steps t ON t.session_id = s.session_id AND t.sequence = s.sequence
    UNION  -- the same step twice in one batch: the first write has it
    SELECT s.w, 'step' FROM new_steps s
    JOIN new_steps o ON o.session_id = s.session_id AND o.sequence = s.sequence AND o.w < s.w
    UNION
    SELECT n.w, 'request' FROM new_tasks n
    JOIN {SCHEMA}.tasks t ON t.agent_id = n.agent_id AND t.request_id = n.request_id AND n.request_id != ''
    UNION  -- the same request id twice in one batch: the first write has it
    SELECT n.w, 'request' FROM new_tasks n
    JOIN new_tasks o ON o.agent_id = n.agent_id AND o.request_id = n.request_id AND n.request_id != ''
        AND o.w < n.w
    UNION
    SELECT m.w, 'task' FROM moves m
    LEFT JOIN {SCHEMA}.tasks t ON t.id = m.id
    WHERE t.id IS NULL OR NOT t.status = ANY(string_to_array(m.expected, ','))
),
refused AS (SELECT DISTINCT w FROM refused_why),
inserted_steps AS (
    INSERT INTO {SCHEMA}.steps (id, agent_id, session_id, run_id, sequence, role, content, reasoning,
                                tool_calls, tool_call_id, name, duration_ms, first_token_ms, input_tokens,
                                output_tokens, cached_tokens, model, tool_duration_ms, created_at,
                                interrupted, kind, summary_through, usage_estimated, origin)
    SELECT id, agent_id, session_id, run_id, sequence, role, content, reasoning, tool_calls::json,
           tool_call_id, name, duration_ms, first_token_ms, input_tokens, output_tokens, cached_tokens,
           model, tool_duration_ms, created_at, interrupted, kind, summary_through, usage_estimated,
           origin::json
    FROM new_steps WHERE w NOT IN (SELECT w FROM refused)
    ON CONFLICT (session_id, sequence) DO NOTHING
    RETURNING session_id, sequence
),
inserted_runs AS (
    INSERT INTO {SCHEMA}.runs (id, agent_id, session_id, status, trigger_message_ids, started_at,
                               iterations, error, ended_at, group_id)
    SELECT id, agent_id, session_id, status, trigger_message_ids::json, started_at, iterations, error,
           ended_at, group_id
    FROM unnest($21::int[], $22::uuid[], $23::uuid[], $24::uuid[], $25::text[], $26::text[],
                $27::timestamptz[], $28::int[], $29::text[], $30::timestamptz[], $49::uuid[])
        AS r(w, id, agent_id, session_id, status, trigger_message_ids, started_at, iterations, error,
             ended_at, group_id)
    WHERE w NOT IN (SELECT w FROM refused)
    RETURNING 1
),
ended_runs AS (
    UPDATE {SCHEMA}.runs AS r
    SET status = e.status, trigger_message_ids = e.trigger_message_ids::json, iterations = e.iterations,
        error = e.error, ended_at = e.ended_at
    FROM unnest($31::int[], $32::uuid[], $33::text[], $34::text[], $35::int[], $36::text[],
                $37::timestamptz[])
        AS e(w, id, status, trigger_message_ids, iterations, error, ended_at)
    WHERE r.id = e.id AND e.w NOT IN (SELECT w FROM refused)
    RETURNING 1
),
progress AS (
    UPDATE {SCHEMA}.agents AS a
    SET state = p.state, last_error = p.last_error, tokens_used = p.tokens_used,
        pause_pending = p.pause_pending, state_version = p.state_version
    FROM unnest($38::int[], $39::uuid[], $40::text[], $41::text[], $42::bigint[], $44::bool[],
                $53::bigint[])
        AS p(w, id, state, last_error, tokens_used, pause_pending, state_version)
    WHERE a.id = p.id AND p.w NOT IN (SELECT w FROM refused)
    RETURNING 1
),
marked AS (
    -- One row per (agent, group), the newest message: ON CONFLICT may touch a row once.
    INSERT INTO {SCHEMA}.read_marks (agent_id, group_id, message_id)
    SELECT DISTINCT ON (agent_id, group_id) agent_id, group_id, message_id
    FROM unnest($45::int[], $46::uuid[], $47::uuid[], $48::uuid[]) AS m(w, agent_id, group_id, message_id)
    WHERE m.w NOT IN (SELECT w FROM refused)
    ORDER BY agent_id, group_id, message_id DESC
    ON CONFLICT (agent_id, group_id) DO UPDATE SET message_id = excluded.message_id
    WHERE excluded.message_id > {SCHEMA}.read_marks.message_id
    RETURNING 1
),
inserted_tasks AS (
    INSERT INTO {SCHEMA}.tasks (id, agent_id, session_id, input, priority, request_id, created_at, status,
                                attempts, last_error, result, started_at, ended_at, retry_at, run_id)
    SELECT id, agent_id, session_id, input, priority, request_id, created_at, status, attempts, last_error,
           result, started_at, ended_at, retry_at, run_id
    FROM new_tasks WHERE w NOT IN (SELECT w FROM refused)
    ON CONFLICT (agent_id, request_id) WHERE request_id != '' DO NOTHING
    RETURNING id
),
audited AS (
    INSERT INTO {SCHEMA}.agent_audit_events ({", ".join(_AUDIT_COLUMNS)})
    SELECT {", ".join(_AUDIT_COLUMNS[:-2])}, details::json, count
    FROM unnest($71::uuid[], $72::uuid[], $73::uuid[], $74::text[], $75::uuid[], $76::text[], $77::text[],
                $78::text[], $79::text[], $80::text[], $81::timestamptz[], $82::timestamptz[], $83::text[],
                $84::text[], $85::text[], $86::text[], $87::int[])
        AS a(task_id, {", ".join(_AUDIT_COLUMNS)})
    WHERE a.task_id IN (SELECT id FROM inserted_tasks)
    RETURNING 1
),
moved_tasks AS (
    UPDATE {SCHEMA}.tasks AS t
    SET status = m.status, attempts = m.attempts, last_error = m.last_error, result = m.result,
        started_at = m.started_at, ended_at = m.ended_at, retry_at = m.retry_at, run_id = m.run_id
    FROM moves m
    WHERE t.id = m.id AND t.status = ANY(string_to_array(m.expected, ','))
      AND m.w NOT IN (SELECT w FROM refused)
    RETURNING m.w
)
SELECT w, min(why) AS why FROM refused_why GROUP BY w
UNION ALL  -- lost a race with a concurrent insert of the same step
SELECT s.w, 'step' FROM new_steps s
WHERE s.w NOT IN (SELECT w FROM refused)
  AND (s.session_id, s.sequence) NOT IN (SELECT session_id, sequence FROM inserted_steps)
UNION ALL  -- ... or of a task with the same request id
SELECT n.w, 'request' FROM new_tasks n
WHERE n.w NOT IN (SELECT w FROM refused) AND n.id NOT IN (SELECT id FROM inserted_tasks)
UNION ALL  -- ... or with a concurrent change of the task
SELECT m.w, 'task' FROM moves m
WHERE m.w NOT IN (SELECT w FROM refused) AND m.w NOT IN (SELECT w FROM moved_tasks)
"""
