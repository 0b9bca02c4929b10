"""The runtime's storage on SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).

`Database` owns the engine; `SqlAgentStore` implements the `AgentStore` port
with SQLAlchemy Core statements that run unchanged on both backends, each
method in one short transaction of its own.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from services.common.sql import SqlDatabase
from services.runtime.adapters.journal import Write, open_journal
from services.runtime.adapters.tables import SCHEMA, agent_requests, agents, runs, steps, watch_cursors
from services.runtime.domain.llm import ChatMessage, ModelSettings, Role, ToolCall
from services.runtime.domain.model import Agent, AgentState, Run, RunStatus, Step, StepMetrics
from services.runtime.service_layer.store import AgentStore, DuplicateAgentRequest

# The execution option that marks a writer's connection (BEGIN IMMEDIATE on SQLite).
_WRITE = "runtime_write"


class Database(SqlDatabase):
    """The runtime's engine (schema `runtime`)."""

    def __init__(self, url: str, *, pool_size: int = 16) -> None:
        super().__init__(url, schema=SCHEMA, write_option=_WRITE, pool_size=pool_size)

    @contextlib.asynccontextmanager
    async def transaction(self, *, write: bool = True) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction that commits when the block ends and
        rolls back if it raises."""
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
        "tools": list(agent.tools),
        "updated_at": agent.updated_at,
        "state": agent.state.value,
        "last_error": agent.last_error,
        "tokens_used": agent.tokens_used,
        "token_budget": agent.token_budget,
    }


def _update_agent(agent: Agent) -> sa.Update:
    return agents.update().where(agents.c.id == agent.id).values(**_agent_settings(agent))


def _insert_run(run: Run) -> sa.Insert:
    return runs.insert().values(
        id=run.id,
        agent_id=run.agent_id,
        session_id=run.session_id,
        started_at=run.started_at,
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
            model=row.model, base_url=row.base_url, temperature=row.temperature, max_tokens=row.max_tokens
        ),
        tools=tuple(row.tools),
        parent_id=row.parent_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
        state=AgentState(row.state),
        last_error=row.last_error,
        tokens_used=int(row.tokens_used),
        token_budget=int(row.token_budget),
        session_id=row.session_id,
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


def _run(row: sa.Row[Any]) -> Run:
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
        "created_at": step.created_at,
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
        ),
        created_at=row.created_at,
    )


_live = sa.not_(agents.c.deleted)


class SqlAgentStore(AgentStore):
    """`AgentStore` on SQLite or PostgreSQL.

    Args:
        database: a migrated database (`services.runtime.adapters.migrate`);
            the store closes it in `aclose`.
    """

    def __init__(self, database: Database) -> None:
        self._db = database
        self._journal = open_journal(database)

    def _insert(self, table: sa.Table) -> sqlite.Insert | postgresql.Insert:
        """The backend's INSERT, which knows ON CONFLICT DO NOTHING: a conflict
        then leaves the transaction usable (PostgreSQL aborts it on an error)."""
        return sqlite.insert(table) if self._db.is_sqlite else postgresql.insert(table)

    async def _rows(self, statement: sa.Executable) -> Sequence[sa.Row[Any]]:
        async with self._db.transaction(write=False) as conn:
            return (await conn.execute(statement)).all()

    async def _write(self, statement: sa.Executable) -> None:
        async with self._db.transaction() as conn:
            await conn.execute(statement)

    # Agents

    async def add_agent(self, agent: Agent, *, request: tuple[uuid.UUID, str, str] | None = None) -> None:
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
            await conn.execute(
                agents.insert().values(
                    id=agent.id,
                    workspace_id=agent.workspace_id,
                    member_id=agent.member_id,
                    parent_id=agent.parent_id,
                    created_at=agent.created_at,
                    session_id=agent.session_id,
                    deleted=False,
                    **_agent_settings(agent),
                )
            )

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

    async def update_agent(self, agent: Agent) -> None:
        await self._write(_update_agent(agent))

    async def save_progress(self, agent: Agent) -> None:
        await self._journal.write(Write(progress=agent))

    async def delete_agent(self, agent_id: uuid.UUID) -> None:
        await self._write(agents.update().where(agents.c.id == agent_id).values(deleted=True))

    # Runs

    async def add_run(self, run: Run) -> None:
        await self._write(_insert_run(run))

    async def begin_run(self, run: Run, agent: Agent, steps_: Sequence[Step]) -> None:
        await self._journal.write(Write(new_run=run, progress=agent, steps=steps_))

    async def update_run(self, run: Run) -> None:
        await self._journal.write(Write(ended_run=run))

    async def end_run(self, run: Run, agent: Agent) -> None:
        await self._journal.write(Write(ended_run=run, progress=agent))

    async def list_runs(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Run]:
        query = runs.select().where(runs.c.agent_id == agent_id).order_by(runs.c.id.desc()).limit(limit)
        if before is not None:
            query = query.where(runs.c.id < before)
        return [_run(r) for r in await self._rows(query)]

    # Steps

    async def append_step(self, step: Step) -> None:
        await self._journal.write(Write(steps=(step,)))

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

    # IM watch cursors

    async def watch_cursors(self) -> dict[uuid.UUID, str]:
        rows = await self._rows(sa.select(watch_cursors.c.workspace_id, watch_cursors.c.cursor))
        return {row.workspace_id: row.cursor for row in rows}

    async def save_watch_cursors(self, cursors: dict[uuid.UUID, str]) -> None:
        if not cursors:
            return
        at = datetime.now(UTC)
        statement = self._insert(watch_cursors).values(
            [{"workspace_id": w, "cursor": c, "updated_at": at} for w, c in cursors.items()]
        )
        await self._write(
            statement.on_conflict_do_update(
                index_elements=[watch_cursors.c.workspace_id],
                set_={"cursor": statement.excluded.cursor, "updated_at": statement.excluded.updated_at},
            )
        )

    async def aclose(self) -> None:
        await self._journal.aclose()
        await self._db.aclose()
