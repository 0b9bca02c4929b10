"""The runtime's storage on SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).

`Database` owns the engine; `SqlAgentStore` implements the `AgentStore` port
with SQLAlchemy Core statements that run unchanged on both backends, each
method in one short transaction of its own.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection
from uuid_utils.compat import uuid7

from services.common.audit import AuditRecord
from services.common.audit_sql import insert_record
from services.common.outages import DATABASE, as_unavailable
from services.common.sql import SqlDatabase
from services.runtime.adapters.journal import (
    TaskMoved,
    TaskRequestTaken,
    Write,
    open_journal,
    origin_of_record,
    origin_record,
)
from services.runtime.adapters.leases import check_fence
from services.runtime.adapters.tables import (
    SCHEMA,
    agent_requests,
    agents,
    audit_events,
    checkpoints,
    read_marks,
    runs,
    sessions,
    step_archive,
    steps,
    tasks,
    watch_cursors,
)
from services.runtime.domain.errors import DuplicateAgentRequest
from services.runtime.domain.llm import ChatMessage, ModelSettings, Role, ToolCall
from services.runtime.domain.model import (
    Agent,
    AgentState,
    Checkpoint,
    Run,
    RunStatus,
    Session,
    Step,
    StepKind,
    StepMetrics,
    Task,
    TaskStatus,
)
from services.runtime.service_layer.leases import Fence, LeaseLost
from services.runtime.service_layer.store import AgentStore, TaskInFlight

# The execution option that marks a writer's connection (BEGIN IMMEDIATE on SQLite).
_WRITE = "runtime_write"


IDLE_IN_TRANSACTION_MS = 5_000


class Database(SqlDatabase):
    """The runtime's engine (schema `runtime`)."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 16,
        busy_timeout_seconds: float = 10.0,
        application_name: str | None = None,
    ) -> None:
        super().__init__(
            url,
            schema=SCHEMA,
            write_option=_WRITE,
            pool_size=pool_size,
            application_name=application_name,
            # A transaction whose client went silent (cut off by a partition,
            # frozen) would keep its locks until TCP gives up, hours later:
            # among them the FOR SHARE locks of fenced writes on lease rows,
            # which the next owner's take must wait for. Every transaction
            # here is a few statements sent back to back.
            server_settings={"idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_MS)},
            busy_timeout_seconds=busy_timeout_seconds,
        )

    @contextlib.asynccontextmanager
    async def transaction(self, *, write: bool = True) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction that commits when the block ends and
        rolls back if it raises.

        Raises:
            DependencyUnavailable: the database cannot serve.
        """
        with as_unavailable(DATABASE):
            async with contextlib.AsyncExitStack() as stack:
                if self.is_sqlite and write:
                    await stack.enter_async_context(self.write_lock)
                conn = await stack.enter_async_context(self.engine.connect())
                if write:
                    conn = await conn.execution_options(**{_WRITE: True})
                elif not self.is_sqlite:
                    # Reads need no BEGIN/COMMIT round trips; each query sees committed data.
                    conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                async with conn.begin():
                    yield conn


def _agent_settings(agent: Agent) -> dict[str, Any]:
    """The columns `update_agent` replaces."""
    return {
        "name": agent.name,
        "role": agent.role,
        "system_prompt": agent.system_prompt,
        "model": agent.model.model,
        "base_url": agent.model.base_url,
        "temperature": agent.model.temperature,
        "max_tokens": agent.model.max_tokens,
        "context_tokens": agent.model.context_tokens,
        "tools": list(agent.tools),
        "updated_at": agent.updated_at,
        "state": agent.state.value,
        "last_error": agent.last_error,
        "tokens_used": agent.tokens_used,
        "token_budget": agent.token_budget,
        "pause_pending": agent.pause_pending,
        "auto_recall": agent.auto_recall,
        "state_version": agent.state_version,
    }


def agent_row(agent: Agent) -> dict[sa.Column[Any], Any]:
    """Every column of a new agent's row."""
    values = {
        "id": agent.id,
        "workspace_id": agent.workspace_id,
        "member_id": agent.member_id,
        "parent_id": agent.parent_id,
        "owner_id": agent.owner_id,
        "created_at": agent.created_at,
        "session_id": agent.session_id,
        "deleted": False,
        **_agent_settings(agent),
    }
    return {agents.c[name]: value for name, value in values.items()}


def _update_agent(agent: Agent) -> sa.Update:
    return agents.update().where(agents.c.id == agent.id).values(**_agent_settings(agent))


def _insert_run(run: Run) -> sa.Insert:
    return runs.insert().values(
        id=run.id,
        agent_id=run.agent_id,
        session_id=run.session_id,
        started_at=run.started_at,
        group_id=run.group_id,
        **_run_progress(run),
    )


def _agent(row: sa.Row[Any]) -> Agent:
    return Agent(
        id=row.id,
        workspace_id=row.workspace_id,
        member_id=row.member_id,
        name=row.name,
        role=row.role,
        system_prompt=row.system_prompt,
        model=ModelSettings(
            model=row.model,
            base_url=row.base_url,
            temperature=row.temperature,
            max_tokens=row.max_tokens,
            context_tokens=row.context_tokens,
        ),
        tools=tuple(row.tools),
        parent_id=row.parent_id,
        owner_id=row.owner_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
        state=AgentState(row.state),
        last_error=row.last_error,
        tokens_used=int(row.tokens_used),
        token_budget=int(row.token_budget),
        session_id=row.session_id,
        pause_pending=bool(row.pause_pending),
        auto_recall=row.auto_recall,
        state_version=int(row.state_version),
    )


def _run_progress(run: Run) -> dict[str, Any]:
    """The columns `update_run` replaces."""
    return {
        "status": run.status.value,
        "trigger_message_ids": [str(m) for m in run.trigger_message_ids],
        "iterations": run.iterations,
        "error": run.error,
        "ended_at": run.ended_at,
    }


def _run(row: sa.Row[Any] | SimpleNamespace) -> Run:
    return Run(
        id=row.id,
        agent_id=row.agent_id,
        session_id=row.session_id,
        status=RunStatus(row.status),
        trigger_message_ids=tuple(uuid.UUID(m) for m in row.trigger_message_ids),
        started_at=row.started_at,
        iterations=int(row.iterations),
        error=row.error,
        ended_at=row.ended_at,
        group_id=row.group_id,
    )


def _step_values(step: Step) -> dict[str, Any]:
    message, metrics = step.message, step.metrics
    return {
        "id": step.id,
        "agent_id": step.agent_id,
        "session_id": step.session_id,
        "run_id": step.run_id,
        "sequence": step.sequence,
        "role": message.role.value,
        "content": message.content,
        "reasoning": message.reasoning,
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls],
        "tool_call_id": message.tool_call_id,
        "name": message.name,
        "duration_ms": metrics.duration_ms,
        "first_token_ms": metrics.first_token_ms,
        "input_tokens": metrics.input_tokens,
        "output_tokens": metrics.output_tokens,
        "cached_tokens": metrics.cached_tokens,
        "model": metrics.model,
        "tool_duration_ms": metrics.tool_duration_ms,
        "usage_estimated": metrics.usage_estimated,
        "created_at": step.created_at,
        "interrupted": step.interrupted,
        "kind": step.kind.value,
        "summary_through": step.summary_through,
        "origin": origin_record(step.origin),
    }


def _step(row: sa.Row[Any]) -> Step:
    return Step(
        id=row.id,
        agent_id=row.agent_id,
        session_id=row.session_id,
        run_id=row.run_id,
        sequence=int(row.sequence),
        message=ChatMessage(
            role=Role(row.role),
            content=row.content,
            reasoning=row.reasoning,
            tool_calls=tuple(
                ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in row.tool_calls
            ),
            tool_call_id=row.tool_call_id,
            name=row.name,
        ),
        metrics=StepMetrics(
            duration_ms=float(row.duration_ms),
            first_token_ms=float(row.first_token_ms),
            input_tokens=int(row.input_tokens),
            output_tokens=int(row.output_tokens),
            cached_tokens=int(row.cached_tokens),
            model=row.model,
            tool_duration_ms=float(row.tool_duration_ms),
            usage_estimated=bool(row.usage_estimated),
        ),
        created_at=row.created_at,
        interrupted=bool(row.interrupted),
        kind=StepKind(row.kind),
        summary_through=int(row.summary_through),
        origin=origin_of_record(row.origin),
    )


_live = sa.not_(agents.c.deleted)
# Ids bound per IN (...) list: far below what either database takes in one statement.
_IDS_PER_QUERY = 1000


def _in_chunks(ids: Collection[uuid.UUID]) -> list[list[uuid.UUID]]:
    """The ids, in order, cut into lists of at most `_IDS_PER_QUERY`."""
    wanted = sorted(ids)
    return [wanted[start : start + _IDS_PER_QUERY] for start in range(0, len(wanted), _IDS_PER_QUERY)]


class SqlAgentStore(AgentStore):
    """`AgentStore` on SQLite or PostgreSQL.

    Args:
        database: a migrated database (`services.runtime.adapters.migrate`);
            the store closes it in `aclose`.
    """

    def __init__(self, database: Database) -> None:
        self._db = database
        self._journal = open_journal(database)
        self._refused_cursor_saves = 0

    def _insert(self, table: sa.Table) -> sqlite.Insert | postgresql.Insert:
        """The backend's INSERT, which knows ON CONFLICT DO NOTHING: a conflict
        then leaves the transaction usable (PostgreSQL aborts it on an error)."""
        return sqlite.insert(table) if self._db.is_sqlite else postgresql.insert(table)

    async def _rows(self, statement: sa.Executable) -> Sequence[sa.Row[Any]]:
        async def read() -> Sequence[sa.Row[Any]]:
            async with self._db.transaction(write=False) as conn:
                return (await conn.execute(statement)).all()

        return await self._db.retry_read(read)

    async def _write(self, statement: sa.Executable, *, audit: AuditRecord | None = None) -> None:
        async with self._db.transaction() as conn:
            result = await conn.execute(statement)
            if audit is not None and (not isinstance(statement, sa.Update) or result.rowcount):
                await insert_record(conn, audit_events, audit)

    async def record_audit(self, record: AuditRecord) -> None:
        async with self._db.transaction() as conn:
            await insert_record(conn, audit_events, record)

    # Agents

    async def add_agent(
        self,
        agent: Agent,
        *,
        request: tuple[uuid.UUID, str, str] | None = None,
        audit: AuditRecord | None = None,
    ) -> None:
        async with self._db.transaction() as conn:
            if request is not None:
                scope, request_id, fingerprint = request
                recorded = await conn.execute(
                    self._insert(agent_requests)
                    .values(
                        scope=scope,
                        request_id=request_id,
                        fingerprint=fingerprint,
                        agent_id=agent.id,
                        created_at=agent.created_at,
                    )
                    .on_conflict_do_nothing(
                        index_elements=[agent_requests.c.scope, agent_requests.c.request_id]
                    )
                )
                if not recorded.rowcount:
                    raise DuplicateAgentRequest(request_id)
            await conn.execute(agents.insert().values(agent_row(agent)))
            if audit is not None:
                await insert_record(conn, audit_events, audit)

    async def find_request(self, scope: uuid.UUID, request_id: str) -> tuple[str, uuid.UUID] | None:
        rows = await self._rows(
            sa.select(agent_requests.c.fingerprint, agent_requests.c.agent_id).where(
                agent_requests.c.scope == scope, agent_requests.c.request_id == request_id
            )
        )
        return (rows[0].fingerprint, rows[0].agent_id) if rows else None

    async def get_agent(self, agent_id: uuid.UUID) -> Agent | None:
        rows = await self._rows(agents.select().where(agents.c.id == agent_id, _live))
        return _agent(rows[0]) if rows else None

    async def list_agents(
        self, workspace_id: uuid.UUID, *, parent_id: uuid.UUID | None, after: uuid.UUID | None, limit: int
    ) -> list[Agent]:
        query = (
            agents.select()
            .where(agents.c.workspace_id == workspace_id, _live)
            .order_by(agents.c.id)
            .limit(limit)
        )
        if parent_id is not None:
            query = query.where(agents.c.parent_id == parent_id)
        if after is not None:
            query = query.where(agents.c.id > after)
        return [_agent(r) for r in await self._rows(query)]

    async def all_agents(self) -> list[Agent]:
        return [_agent(r) for r in await self._rows(agents.select().where(_live).order_by(agents.c.id))]

    async def agent_places(self) -> dict[uuid.UUID, uuid.UUID]:
        rows = await self._rows(sa.select(agents.c.id, agents.c.workspace_id).where(_live))
        return {row.id: row.workspace_id for row in rows}

    async def get_agents(self, agent_ids: Collection[uuid.UUID]) -> list[Agent]:
        found: list[Agent] = []
        for chunk in _in_chunks(agent_ids):
            found += [
                _agent(r) for r in await self._rows(agents.select().where(agents.c.id.in_(chunk), _live))
            ]
        return found

    async def update_agent(self, agent: Agent, *, audit: AuditRecord | None = None) -> None:
        await self._write(_update_agent(agent), audit=audit)

    async def save_progress(self, agent: Agent, *, fence: Fence | None = None) -> None:
        await self._journal.write(Write(progress=agent, fence=fence))

    async def delete_agent(self, agent_id: uuid.UUID, *, audit: AuditRecord | None = None) -> None:
        await self._write(agents.update().where(agents.c.id == agent_id).values(deleted=True), audit=audit)

    # Runs

    async def add_run(self, run: Run) -> None:
        await self._write(_insert_run(run))

    async def begin_run(
        self,
        run: Run,
        agent: Agent,
        steps_: Sequence[Step],
        *,
        read_marks: Mapping[uuid.UUID, uuid.UUID] | None = None,
        fence: Fence | None = None,
    ) -> None:
        await self._journal.write(
            Write(
                new_run=run,
                progress=agent,
                steps=steps_,
                marks_of=agent.id if read_marks else None,
                read_marks=read_marks or {},
                fence=fence,
            )
        )

    async def update_run(self, run: Run) -> None:
        await self._journal.write(Write(ended_run=run))

    async def end_run(self, run: Run, agent: Agent, *, fence: Fence | None = None) -> None:
        await self._journal.write(Write(ended_run=run, progress=agent, fence=fence))

    async def list_runs(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Run]:
        query = runs.select().where(runs.c.agent_id == agent_id).order_by(runs.c.id.desc()).limit(limit)
        if before is not None:
            query = query.where(runs.c.id < before)
        return [_run(r) for r in await self._rows(query)]

    async def running_run(self, agent_id: uuid.UUID) -> Run | None:
        query = (
            runs.select()
            .where(runs.c.agent_id == agent_id, runs.c.status == RunStatus.RUNNING.value)
            .order_by(runs.c.id.desc())
            .limit(1)
        )
        found = await self._rows(query)
        return _run(found[0]) if found else None

    # Steps

    async def append_step(self, step: Step, *, fence: Fence | None = None) -> None:
        await self._journal.write(Write(steps=(step,), fence=fence))

    async def append_input(
        self,
        agent_id: uuid.UUID,
        steps_: Sequence[Step],
        read_marks_: Mapping[uuid.UUID, uuid.UUID],
        *,
        fence: Fence | None = None,
    ) -> None:
        await self._journal.write(Write(steps=steps_, marks_of=agent_id, read_marks=read_marks_, fence=fence))

    async def read_marks(self, agent_id: uuid.UUID) -> dict[uuid.UUID, uuid.UUID]:
        rows = await self._rows(
            sa.select(read_marks.c.group_id, read_marks.c.message_id).where(read_marks.c.agent_id == agent_id)
        )
        return {row.group_id: row.message_id for row in rows}

    async def list_steps(
        self, session_id: uuid.UUID, *, after_sequence: int, limit: int, run_id: uuid.UUID | None = None
    ) -> list[Step]:
        query = (
            steps.select()
            .where(steps.c.session_id == session_id, steps.c.sequence > after_sequence)
            .order_by(steps.c.sequence)
            .limit(limit)
        )
        if run_id is not None:
            query = query.where(steps.c.run_id == run_id)
        return [_step(r) for r in await self._rows(query)]

    async def last_sequence(self, session_id: uuid.UUID) -> int:
        rows = await self._rows(
            sa.select(sa.func.max(steps.c.sequence)).where(steps.c.session_id == session_id)
        )
        return int(rows[0][0] or 0)

    # -- History: sessions, checkpoints, the step archive (the history handlers) --

    async def add_session(self, session: Session) -> None:
        await self._write(
            self._insert(sessions)
            .values(**_session_values(session))
            .on_conflict_do_nothing(index_elements=[sessions.c.id])
        )

    async def get_session(self, session_id: uuid.UUID) -> Session | None:
        rows = await self._rows(sessions.select().where(sessions.c.id == session_id))
        return _session(rows[0]) if rows else None

    async def list_sessions(self, agent_id: uuid.UUID) -> list[tuple[Session, int]]:
        count = (
            sa.select(sa.func.count())
            .where(steps.c.session_id == sessions.c.id)
            .scalar_subquery()
            .label("step_count")
        )
        rows = await self._rows(
            sa.select(sessions, count)
            .where(sessions.c.agent_id == agent_id)
            .order_by(sessions.c.created_at, sessions.c.id)
        )
        return [(_session(row), int(row.step_count)) for row in rows]

    async def set_main_session(
        self, agent_id: uuid.UUID, session_id: uuid.UUID, *, audit: AuditRecord | None = None
    ) -> None:
        await self._write(
            agents.update().where(agents.c.id == agent_id).values(session_id=session_id), audit=audit
        )

    async def fork_session(self, session: Session, *, audit: AuditRecord | None = None) -> int:
        assert session.forked_from is not None
        async with self._db.transaction() as conn:
            marked = await conn.execute(
                sessions.update()
                .where(sessions.c.id == session.id)
                .values(forked_from=session.forked_from, forked_at_sequence=session.forked_at_sequence)
            )
            if not marked.rowcount:
                await conn.execute(sessions.insert().values(**_session_values(session)))
            source = (
                await conn.execute(
                    steps.select()
                    .where(
                        steps.c.session_id == session.forked_from,
                        steps.c.sequence <= session.forked_at_sequence,
                    )
                    .order_by(steps.c.sequence)
                )
            ).all()
            copies = [
                {**row._asdict(), "id": uuid7(), "session_id": session.id, "agent_id": session.agent_id}
                for row in source
            ]
            if copies:
                await conn.execute(steps.insert(), copies)
            if audit is not None:
                await insert_record(conn, audit_events, audit)
            return len(copies)

    async def edit_step(
        self, step_id: uuid.UUID, content: str, *, at: datetime, audit: AuditRecord | None = None
    ) -> bool:
        async with self._db.transaction() as conn:
            archived = await _archive(conn, steps.c.id == step_id, reason="edited", at=at, remove=False)
            if not archived:
                return False
            await conn.execute(steps.update().where(steps.c.id == step_id).values(content=content))
            if audit is not None:
                await insert_record(conn, audit_events, audit)
            return True

    async def archive_steps(
        self,
        session_id: uuid.UUID,
        *,
        reason: str,
        at: datetime,
        sequences: Sequence[int] = (),
        after_sequence: int | None = None,
        audit: AuditRecord | None = None,
    ) -> int:
        async with self._db.transaction() as conn:
            moved = await _archive(conn, _chosen(session_id, sequences, after_sequence), reason=reason, at=at)
            if audit is not None and moved:
                await insert_record(conn, audit_events, audit)
            return moved

    async def archived_steps(self, session_id: uuid.UUID) -> list[tuple[str, Step]]:
        rows = await self._rows(
            step_archive.select()
            .where(step_archive.c.session_id == session_id)
            .order_by(step_archive.c.archived_at, step_archive.c.sequence, step_archive.c.archive_id)
        )
        return [(row.reason, _step(row)) for row in rows]

    async def add_checkpoint(self, checkpoint: Checkpoint, *, audit: AuditRecord | None = None) -> None:
        settings = checkpoint.settings
        await self._write(
            checkpoints.insert().values(
                id=checkpoint.id,
                agent_id=checkpoint.agent_id,
                name=checkpoint.name,
                session_id=checkpoint.session_id,
                sequence=checkpoint.sequence,
                settings={
                    "name": settings.name,
                    "role": settings.role,
                    "system_prompt": settings.system_prompt,
                    "model": {
                        "model": settings.model.model,
                        "base_url": settings.model.base_url,
                        "temperature": settings.model.temperature,
                        "max_tokens": settings.model.max_tokens,
                        "context_tokens": settings.model.context_tokens,
                    },
                    "tools": list(settings.tools),
                    "token_budget": settings.token_budget,
                    "auto_recall": settings.auto_recall,
                },
                created_at=checkpoint.created_at,
            ),
            audit=audit,
        )

    async def get_checkpoint(self, checkpoint_id: uuid.UUID) -> Checkpoint | None:
        found = await self._checkpoints(checkpoints.c.id == checkpoint_id, limit=1)
        return found[0] if found else None

    async def list_checkpoints(
        self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int
    ) -> list[Checkpoint]:
        condition = checkpoints.c.agent_id == agent_id
        if before is not None:
            condition = sa.and_(condition, checkpoints.c.id < before)
        return await self._checkpoints(condition, limit=limit)

    async def _checkpoints(self, condition: sa.ColumnElement[bool], *, limit: int) -> list[Checkpoint]:
        async with self._db.transaction(write=False) as conn:
            rows = (
                await conn.execute(
                    checkpoints.select().where(condition).order_by(checkpoints.c.id.desc()).limit(limit)
                )
            ).all()
            owners = {r.agent_id for r in rows}
            found = (await conn.execute(agents.select().where(agents.c.id.in_(owners)))).all() if rows else []
        agents_by_id = {row.id: _agent(row) for row in found}
        return [_checkpoint(row, agents_by_id[row.agent_id]) for row in rows if row.agent_id in agents_by_id]

    async def restore_checkpoint(self, checkpoint: Checkpoint, *, at: datetime) -> int:
        async with self._db.transaction() as conn:
            archived = await _archive(
                conn,
                _chosen(checkpoint.session_id, (), checkpoint.sequence),
                reason="restored",
                at=at,
            )
            await conn.execute(
                agents.update()
                .where(agents.c.id == checkpoint.agent_id)
                .values(session_id=checkpoint.session_id)
            )
            return archived

    # -- Tasks (TaskService) --

    async def add_task(self, task: Task, *, audit: AuditRecord | None = None) -> Task:
        # Through the journal: submissions arriving together share a commit.
        try:
            await self._journal.write(Write(new_task=task, audit=audit))
        except TaskRequestTaken:
            # Committed before this one (a concurrent submission, or a retry).
            found = await self.find_task(task.agent_id, task.request_id)
            if found is None:
                raise
            return found
        return task

    async def get_task(self, task_id: uuid.UUID) -> Task | None:
        rows = await self._rows(tasks.select().where(tasks.c.id == task_id))
        return _task(rows[0]) if rows else None

    async def find_task(self, agent_id: uuid.UUID, request_id: str) -> Task | None:
        rows = await self._rows(
            tasks.select().where(tasks.c.agent_id == agent_id, tasks.c.request_id == request_id, _has_request)
        )
        return _task(rows[0]) if rows else None

    async def list_tasks(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Task]:
        query = tasks.select().where(tasks.c.agent_id == agent_id).order_by(tasks.c.id.desc()).limit(limit)
        if before is not None:
            query = query.where(tasks.c.id < before)
        return [_task(r) for r in await self._rows(query)]

    async def next_task(self, agent_id: uuid.UUID, *, now: datetime) -> Task | None:
        # Two heads, each the start of a range of ix_tasks_queue: the oldest
        # QUEUED task of the highest priority queued, and the first FAILED
        # task whose retry is due (few: those waiting out a backoff).
        top = tasks.alias("top")
        highest = (
            sa.select(sa.func.max(top.c.priority))
            .where(top.c.agent_id == agent_id, top.c.status == TaskStatus.QUEUED.value)
            .scalar_subquery()
        )
        queued = (
            tasks.select()
            .where(
                tasks.c.agent_id == agent_id,
                tasks.c.status == TaskStatus.QUEUED.value,
                tasks.c.priority == highest,
            )
            .order_by(tasks.c.created_at, tasks.c.id)
            .limit(1)
        )
        due = (
            tasks.select()
            .where(tasks.c.agent_id == agent_id, _retry_due(now))
            .order_by(tasks.c.priority.desc(), tasks.c.created_at, tasks.c.id)
            .limit(1)
        )
        async with self._db.transaction(write=False) as conn:
            heads = [_task(r) for q in (queued, due) for r in (await conn.execute(q)).all()]
        return min(heads, key=_queue_order, default=None)

    async def agents_with_waiting_tasks(self) -> set[uuid.UUID]:
        query = sa.select(tasks.c.agent_id).where(_waiting).distinct()
        return {row.agent_id for row in await self._rows(query)}

    async def waiting_tasks(self, agent_id: uuid.UUID) -> list[Task]:
        query = tasks.select().where(tasks.c.agent_id == agent_id, tasks.c.status.in_(_WAITING))
        return [_task(r) for r in await self._rows(query)]

    async def tasks_ahead(self, task: Task, *, now: datetime) -> int:
        ahead = sa.or_(
            tasks.c.priority > task.priority,
            sa.and_(
                tasks.c.priority == task.priority,
                sa.or_(
                    tasks.c.created_at < task.created_at,
                    sa.and_(tasks.c.created_at == task.created_at, tasks.c.id < task.id),
                ),
            ),
        )

        def counted(waiting: sa.ColumnElement[bool]) -> sa.ScalarSelect[int]:
            # One index range per status, rather than all the agent's tasks ever.
            return (
                sa.select(sa.func.count())
                .select_from(tasks)
                .where(tasks.c.agent_id == task.agent_id, waiting, ahead)
                .scalar_subquery()
            )

        queued = counted(tasks.c.status == TaskStatus.QUEUED.value)
        rows = await self._rows(sa.select(queued + counted(_retry_due(now))))
        return int(rows[0][0])

    async def next_retry_at(self, agent_id: uuid.UUID) -> datetime | None:
        rows = await self._rows(
            sa.select(sa.func.min(tasks.c.retry_at)).where(
                tasks.c.agent_id == agent_id, tasks.c.status == TaskStatus.FAILED.value
            )
        )
        found: datetime | None = rows[0][0]
        return found

    async def update_task(
        self, task: Task, *, expected: Collection[TaskStatus], fence: Fence | None = None
    ) -> bool:
        try:
            await self._journal.write(Write(task=task, task_expected=tuple(expected), fence=fence))
        except TaskMoved:
            return False
        return True

    async def cancel_waiting_tasks(self, agent_id: uuid.UUID, *, at: datetime) -> list[Task]:
        async with self._db.transaction() as conn:
            rows = await conn.execute(
                tasks.update()
                .where(tasks.c.agent_id == agent_id, tasks.c.status.in_(_WAITING))
                .values(status=TaskStatus.CANCELLED.value, ended_at=at, retry_at=None)
                .returning(*tasks.c)
            )
            return sorted((_task(r) for r in rows.all()), key=lambda t: t.id)

    async def running_tasks(self, agent_id: uuid.UUID | None = None) -> list[TaskInFlight]:
        run = runs.alias("run")
        live = sa.and_(agents.c.id == tasks.c.agent_id, _live)
        query = (
            sa.select(tasks, agents.c.state.label("agent_state"), *[c.label(f"r_{c.name}") for c in run.c])
            .select_from(tasks.outerjoin(run, run.c.id == tasks.c.run_id).outerjoin(agents, live))
            .where(_running)
        )
        if agent_id is not None:
            query = query.where(tasks.c.agent_id == agent_id)
        found: list[TaskInFlight] = []
        for row in await self._rows(query):
            stored = None
            if row.r_id is not None:
                stored = _run(SimpleNamespace(**{c.name: getattr(row, f"r_{c.name}") for c in run.c}))
            state = AgentState(row.agent_state) if row.agent_state is not None else None
            found.append(TaskInFlight(_task(row), stored, state))
        # Sorted here: ORDER BY id would have SQLite walk every task in id
        # order rather than read the few running ones and sort them.
        return sorted(found, key=lambda flight: flight.task.id)

    async def unarchived_runs(self, *, limit: int) -> list[Run]:
        ended = runs.c.ended_at.is_not(None)
        query = (
            runs.select()
            .where(runs.c.archived_at.is_(None), ended)
            .order_by(runs.c.ended_at, runs.c.id)
            .limit(limit)
        )
        return [_run(r) for r in await self._rows(query)]

    async def mark_archived(self, run_id: uuid.UUID, *, at: datetime) -> None:
        await self._write(runs.update().where(runs.c.id == run_id).values(archived_at=at))

    async def end_stale_runs(
        self, *, error: str, at: datetime, agent_ids: Collection[uuid.UUID] | None = None
    ) -> int:
        idle = sa.select(agents.c.id).where(agents.c.state != AgentState.RUNNING.value)
        chunks = (
            [idle] if agent_ids is None else [idle.where(agents.c.id.in_(c)) for c in _in_chunks(agent_ids)]
        )
        ended = 0
        async with self._db.transaction() as conn:
            for chunk in chunks:
                result = await conn.execute(
                    runs.update()
                    .where(runs.c.status == RunStatus.RUNNING.value, runs.c.agent_id.in_(chunk))
                    .values(status=RunStatus.INTERRUPTED.value, error=error, ended_at=at)
                )
                ended += int(result.rowcount)
        return ended

    async def queue_stats(self, agent_id: uuid.UUID) -> tuple[int, int, float]:
        if self._db.is_sqlite:
            days = sa.func.julianday(tasks.c.started_at) - sa.func.julianday(tasks.c.created_at)
            wait_ms = days * 86_400_000
        else:
            wait_ms = sa.extract("epoch", tasks.c.started_at - tasks.c.created_at) * 1000
        running = tasks.c.status == TaskStatus.RUNNING.value
        rows = await self._rows(
            sa.select(
                sa.func.sum(sa.case((tasks.c.status.in_(_WAITING), 1), else_=0)).label("waiting"),
                sa.func.sum(sa.case((running, 1), else_=0)).label("running"),
                # Tasks never started have no started_at: avg leaves them out.
                sa.func.avg(wait_ms).label("average"),
            ).where(tasks.c.agent_id == agent_id)
        )
        row = rows[0]
        return int(row.waiting or 0), int(row.running or 0), float(row.average or 0.0)

    # IM watch cursors

    async def watch_cursors(self) -> dict[uuid.UUID, str]:
        rows = await self._rows(sa.select(watch_cursors.c.workspace_id, watch_cursors.c.cursor))
        return {row.workspace_id: row.cursor for row in rows}

    async def save_watch_cursors(
        self, cursors: dict[uuid.UUID, str], *, fences: Sequence[Fence] = ()
    ) -> None:
        if not cursors:
            return
        at = datetime.now(UTC)
        statement = self._insert(watch_cursors).values(
            [{"workspace_id": w, "cursor": c, "updated_at": at} for w, c in cursors.items()]
        )
        try:
            async with self._db.transaction() as conn:
                for fence in fences:
                    await check_fence(conn, fence)
                await conn.execute(
                    statement.on_conflict_do_update(
                        index_elements=[watch_cursors.c.workspace_id],
                        set_={
                            "cursor": statement.excluded.cursor,
                            "updated_at": statement.excluded.updated_at,
                        },
                    )
                )
        except LeaseLost:
            self._refused_cursor_saves += 1
            raise

    @property
    def refused_fenced_writes(self) -> int:
        return self._journal.refused_fenced_writes + self._refused_cursor_saves

    async def aclose(self) -> None:
        await self._journal.aclose()
        await self._db.aclose()


# -- History helpers (the history handlers) --


def _session_values(session: Session) -> dict[str, Any]:
    return {
        "id": session.id,
        "agent_id": session.agent_id,
        "created_at": session.created_at,
        "forked_from": session.forked_from,
        "forked_at_sequence": session.forked_at_sequence,
    }


def _session(row: sa.Row[Any]) -> Session:
    return Session(
        id=row.id,
        agent_id=row.agent_id,
        created_at=row.created_at,
        forked_from=row.forked_from,
        forked_at_sequence=int(row.forked_at_sequence),
    )


def _chosen(session_id: uuid.UUID, sequences: Sequence[int], after: int | None) -> sa.ColumnElement[bool]:
    """The steps of a session with these sequence numbers or after `after`."""
    picked: list[sa.ColumnElement[bool]] = []
    if sequences:
        picked.append(steps.c.sequence.in_(list(sequences)))
    if after is not None:
        picked.append(steps.c.sequence > after)
    return sa.and_(steps.c.session_id == session_id, sa.or_(sa.false(), *picked))


async def _archive(
    conn: AsyncConnection,
    condition: sa.ColumnElement[bool],
    *,
    reason: str,
    at: datetime,
    remove: bool = True,
) -> int:
    """Copies the chosen steps, whole, to the archive and (`remove`) takes them
    out of their session; returns how many (in the caller's transaction)."""
    rows = (await conn.execute(steps.select().where(condition))).all()
    if not rows:
        return 0
    await conn.execute(
        step_archive.insert(),
        [{**row._asdict(), "archive_id": uuid7(), "archived_at": at, "reason": reason} for row in rows],
    )
    if remove:
        await conn.execute(steps.delete().where(steps.c.id.in_([row.id for row in rows])))
    # Their runs go to memory again, to replace what it has of them.
    await conn.execute(
        runs.update()
        .where(runs.c.id.in_({row.run_id for row in rows}), runs.c.ended_at.is_not(None))
        .values(archived_at=None)
    )
    return len(rows)


def _checkpoint(row: sa.Row[Any], agent: Agent) -> Checkpoint:
    """A checkpoint row; its settings over its agent as stored now."""
    saved = row.settings
    model = saved["model"]
    return Checkpoint(
        id=row.id,
        agent_id=row.agent_id,
        name=row.name,
        session_id=row.session_id,
        sequence=int(row.sequence),
        settings=replace(
            agent,
            name=saved["name"],
            role=saved["role"],
            system_prompt=saved["system_prompt"],
            model=ModelSettings(
                model=model["model"],
                base_url=model["base_url"],
                temperature=model["temperature"],
                max_tokens=model["max_tokens"],
                context_tokens=model.get("context_tokens"),
            ),
            tools=tuple(saved["tools"]),
            token_budget=int(saved["token_budget"]),
            auto_recall=saved.get("auto_recall"),
        ),
        created_at=row.created_at,
    )


# -- Task helpers (TaskService) --

_WAITING = [TaskStatus.QUEUED.value, TaskStatus.FAILED.value]
# The partial unique index uq_tasks_agent_request covers the tasks with a request_id.
# Written out, not bound: PostgreSQL matches ON CONFLICT (and a query) to the
# partial index uq_tasks_agent_request only when it sees the literal (a bound
# "" works for a prepared statement's first five runs, until its plan turns generic).
_has_request = sa.text("request_id != ''")
# The same for the partial indexes ix_tasks_waiting and ix_tasks_running, which
# the reconciles' looks across all agents need (SQLite, too, matches a partial
# index only to the literal).
_waiting = tasks.c.status.in_([sa.literal_column(f"'{status}'") for status in _WAITING])
_running = tasks.c.status == sa.literal_column(f"'{TaskStatus.RUNNING.value}'")


def _retry_due(now: datetime) -> sa.ColumnElement[bool]:
    return sa.and_(tasks.c.status == TaskStatus.FAILED.value, tasks.c.retry_at <= now)


def _queue_order(task: Task) -> tuple[int, datetime, uuid.UUID]:
    """The order tasks are served in: higher priority first, then arrival."""
    return (-task.priority, task.created_at, task.id)


def _task(row: sa.Row[Any]) -> Task:
    return Task(
        id=row.id,
        agent_id=row.agent_id,
        session_id=row.session_id,
        input=row.input,
        status=TaskStatus(row.status),
        created_at=row.created_at,
        priority=int(row.priority),
        attempts=int(row.attempts),
        last_error=row.last_error,
        result=row.result,
        request_id=row.request_id,
        started_at=row.started_at,
        ended_at=row.ended_at,
        retry_at=row.retry_at,
        run_id=row.run_id,
    )
