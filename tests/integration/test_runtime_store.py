"""The runtime's `SqlAgentStore` against real SQLite and PostgreSQL.

SQLite tests get a fresh file each; PostgreSQL tests share the `runtime`
schema (dropped, re-created and migrated once per session) and use fresh ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection
from uuid_utils.compat import uuid7

from services.common import audit
from services.runtime.adapters import migrate
from services.runtime.adapters.sql import Database, SqlAgentStore, agent_row
from services.runtime.adapters.tables import SCHEMA, agents, audit_events, metadata
from services.runtime.domain.errors import DuplicateAgentRequest, DuplicateStep
from services.runtime.domain.llm import ChatMessage, ModelSettings, Role, ToolCall
from services.runtime.domain.model import (
    Agent,
    AgentState,
    Checkpoint,
    Run,
    RunStatus,
    Session,
    Step,
    StepMetrics,
    Task,
    TaskStatus,
)


def now() -> datetime:
    return datetime.now(UTC)


def make_agent(workspace_id: uuid.UUID | None = None, **fields: Any) -> Agent:
    values: dict[str, Any] = {
        "id": uuid7(),
        "workspace_id": workspace_id or uuid.uuid4(),
        "member_id": uuid.uuid4(),
        "name": "agent",
        "role": "",
        "system_prompt": "",
        "model": ModelSettings(),
        "tools": (),
        "parent_id": None,
        "created_at": now(),
        "updated_at": now(),
        "owner_id": uuid.uuid4(),
    }
    values.update(fields)
    return Agent(**values)


def make_run(agent: Agent, **fields: Any) -> Run:
    values: dict[str, Any] = {
        "id": uuid7(),
        "agent_id": agent.id,
        "session_id": agent.session_id,
        "status": RunStatus.RUNNING,
        "trigger_message_ids": (),
        "started_at": now(),
    }
    values.update(fields)
    return Run(**values)


def make_step(run: Run, sequence: int, message: ChatMessage | None = None, **fields: Any) -> Step:
    values: dict[str, Any] = {
        "id": uuid7(),
        "agent_id": run.agent_id,
        "session_id": run.session_id,
        "run_id": run.id,
        "sequence": sequence,
        "message": message or ChatMessage(role=Role.ASSISTANT, content=f"step {sequence}"),
        "metrics": StepMetrics(),
        "created_at": now(),
    }
    values.update(fields)
    return Step(**values)


# Agents


async def test_agent_round_trips_every_field(store: SqlAgentStore) -> None:
    parent = make_agent()
    full = make_agent(
        parent.workspace_id,
        name="研究员 🤖",
        role="finds things out — «carefully»",
        system_prompt="You are helpful.\n\nAnswer in 中文 when asked.",
        model=ModelSettings(model="gpt-x", base_url="http://127.0.0.1:9/v1", temperature=0.0, max_tokens=512),
        tools=("send_message", "search_history"),
        parent_id=parent.id,
        # Another zone on the way in: the same instant comes back in UTC.
        updated_at=datetime.now(timezone(timedelta(hours=8))),
        state=AgentState.ERROR,
        last_error="the model said no ❌",
        tokens_used=12_345_678_901,
        token_budget=99_999_999_999,
    )
    await store.add_agent(parent)
    await store.add_agent(full)

    got = await store.get_agent(full.id)
    assert got == full
    assert got is not None and got.updated_at.tzinfo is UTC
    assert await store.get_agent(parent.id) == parent
    assert await store.get_agent(uuid.uuid4()) is None


async def test_model_settings_keep_none_apart_from_zero(store: SqlAgentStore) -> None:
    unset = make_agent(model=ModelSettings(temperature=None, max_tokens=None))
    zero = make_agent(model=ModelSettings(temperature=0.0, max_tokens=0))
    for agent in (unset, zero):
        await store.add_agent(agent)
        assert await store.get_agent(agent.id) == agent


async def test_update_agent_replaces_settings_state_and_tokens(store: SqlAgentStore) -> None:
    agent = make_agent(tools=("a",))
    await store.add_agent(agent)
    changed = dataclasses.replace(
        agent,
        name="renamed",
        role="reviewer",
        system_prompt="新的提示",
        model=ModelSettings(model="m2", base_url="http://x", temperature=1.5, max_tokens=64),
        tools=(),
        updated_at=agent.updated_at + timedelta(seconds=5),
        state=AgentState.RUNNING,
        last_error="",
        tokens_used=77,
        token_budget=1000,
    )
    await store.update_agent(changed)
    assert await store.get_agent(agent.id) == changed


async def test_delete_hides_the_agent_and_keeps_its_runs_and_steps(store: SqlAgentStore) -> None:
    agent = make_agent()
    sibling = make_agent(agent.workspace_id)
    await store.add_agent(agent)
    await store.add_agent(sibling)
    run = make_run(agent)
    await store.add_run(run)
    step = make_step(run, 1)
    await store.append_step(step)

    await store.delete_agent(agent.id)
    await store.delete_agent(agent.id)  # again: still fine

    assert await store.get_agent(agent.id) is None
    listed = await store.list_agents(agent.workspace_id, parent_id=None, after=None, limit=10)
    assert listed == [sibling]
    every = {a.id for a in await store.all_agents()}
    assert sibling.id in every and agent.id not in every
    assert await store.list_runs(agent.id, before=None, limit=10) == [run]
    assert await store.list_steps(agent.session_id, after_sequence=0, limit=10) == [step]


async def test_list_agents_pages_in_id_order_and_filters_by_parent(store: SqlAgentStore) -> None:
    workspace_id = uuid.uuid4()
    parent = make_agent(workspace_id)
    children = [make_agent(workspace_id, parent_id=parent.id, name=f"child {i}") for i in range(3)]
    others = [make_agent(workspace_id) for _ in range(2)]
    elsewhere = make_agent()
    # Stored out of order: the listing orders by id.
    for agent in [*reversed(children), elsewhere, *others, parent]:
        await store.add_agent(agent)
    everyone = sorted([parent, *children, *others], key=lambda a: a.id)

    pages: list[list[Agent]] = []
    after: uuid.UUID | None = None
    while True:
        page = await store.list_agents(workspace_id, parent_id=None, after=after, limit=2)
        if not page:
            break
        pages.append(page)
        after = page[-1].id
    assert [len(p) for p in pages] == [2, 2, 2]
    assert [a for p in pages for a in p] == everyone

    assert await store.list_agents(workspace_id, parent_id=parent.id, after=None, limit=10) == sorted(
        children, key=lambda a: a.id
    )
    first = await store.list_agents(workspace_id, parent_id=parent.id, after=None, limit=1)
    rest = await store.list_agents(workspace_id, parent_id=parent.id, after=first[0].id, limit=10)
    assert first + rest == sorted(children, key=lambda a: a.id)
    assert await store.list_agents(uuid.uuid4(), parent_id=None, after=None, limit=10) == []


async def test_all_agents_lists_every_live_agent(store: SqlAgentStore) -> None:
    agents = [make_agent() for _ in range(3)]
    for agent in agents:
        await store.add_agent(agent)
    await store.delete_agent(agents[1].id)
    found = await store.all_agents()
    ids = [a.id for a in found]
    assert agents[0] in found and agents[2] in found and agents[1].id not in ids
    assert ids == sorted(ids)


async def test_agent_places_and_get_agents_skip_deleted_agents(store: SqlAgentStore) -> None:
    agents = [make_agent() for _ in range(5)]
    for agent in agents:
        await store.add_agent(agent)
    await store.delete_agent(agents[1].id)
    places = await store.agent_places()
    assert {a.id: a.workspace_id for a in agents if a.id != agents[1].id}.items() <= places.items()
    assert agents[1].id not in places
    # More ids than one statement takes (unknown ones among them).
    found = await store.get_agents([a.id for a in agents] + [uuid.uuid4() for _ in range(2500)])
    assert sorted(found, key=lambda a: a.id) == sorted(
        [a for a in agents if a.id != agents[1].id], key=lambda a: a.id
    )
    assert await store.get_agents([]) == []


async def test_create_requests_are_recorded_once(store: SqlAgentStore) -> None:
    scope = uuid.uuid4()
    first = make_agent()
    await store.add_agent(first, request=(scope, "req-1", "f" * 64))
    assert await store.find_request(scope, "req-1") == ("f" * 64, first.id)

    retry = make_agent()
    with pytest.raises(DuplicateAgentRequest):
        await store.add_agent(retry, request=(scope, "req-1", "other"))
    # The refused call stored nothing.
    assert await store.get_agent(retry.id) is None
    assert await store.find_request(scope, "req-1") == ("f" * 64, first.id)

    # The same request_id in another scope, and no request at all, are independent.
    other_scope = make_agent()
    await store.add_agent(other_scope, request=(uuid.uuid4(), "req-1", "x"))
    assert await store.get_agent(other_scope.id) == other_scope
    assert await store.find_request(scope, "req-2") is None
    assert await store.find_request(uuid.uuid4(), "req-1") is None


async def test_concurrent_creates_with_one_request_id_store_one_agent(store: SqlAgentStore) -> None:
    scope = uuid.uuid4()
    candidates = [make_agent(), make_agent()]
    outcomes = await asyncio.gather(
        *(store.add_agent(a, request=(scope, "same", "fp")) for a in candidates), return_exceptions=True
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["DuplicateAgentRequest", "NoneType"]
    winner = candidates[outcomes.index(None)]
    assert await store.find_request(scope, "same") == ("fp", winner.id)
    assert [await store.get_agent(a.id) for a in candidates].count(None) == 1


# Runs


async def test_run_round_trip_and_update(store: SqlAgentStore) -> None:
    agent = make_agent()
    await store.add_agent(agent)
    run = make_run(agent, trigger_message_ids=(uuid7(), uuid7()))
    await store.add_run(run)
    assert await store.list_runs(agent.id, before=None, limit=10) == [run]

    ended = dataclasses.replace(
        run,
        status=RunStatus.BUDGET_EXHAUSTED,
        iterations=7,
        error="budget: 1000 tokens ✋",
        ended_at=run.started_at + timedelta(seconds=3),
    )
    await store.update_run(ended)
    assert await store.list_runs(agent.id, before=None, limit=10) == [ended]


async def test_save_progress_keeps_the_settings_and_end_run_stores_both(store: SqlAgentStore) -> None:
    agent = make_agent(tools=("a",))
    await store.add_agent(agent)
    renamed = dataclasses.replace(agent, name="renamed", updated_at=agent.updated_at + timedelta(seconds=1))
    await store.update_agent(renamed)
    # The runner holds an older copy of the settings: it must not write them back.
    busy = dataclasses.replace(agent, state=AgentState.ERROR, last_error="down ✋", tokens_used=12)
    await store.save_progress(busy)
    expected = dataclasses.replace(renamed, state=AgentState.ERROR, last_error="down ✋", tokens_used=12)
    assert await store.get_agent(agent.id) == expected

    run = make_run(agent)
    await store.begin_run(run, dataclasses.replace(busy, state=AgentState.RUNNING), [make_step(run, 1)])
    ended = dataclasses.replace(run, status=RunStatus.COMPLETED, iterations=1, ended_at=run.started_at)
    await store.end_run(ended, dataclasses.replace(busy, state=AgentState.IDLE, last_error=""))
    assert await store.list_runs(agent.id, before=None, limit=10) == [ended]
    stored = await store.get_agent(agent.id)
    assert stored is not None and stored.state is AgentState.IDLE and stored.name == "renamed"


async def test_a_run_begun_with_a_taken_step_is_not_stored_at_all(store: SqlAgentStore) -> None:
    agent = make_agent()
    await store.add_agent(agent)
    first = make_run(agent)
    await store.begin_run(first, agent, [make_step(first, 1)])
    stale = make_run(agent)
    with pytest.raises(DuplicateStep):
        await store.begin_run(stale, dataclasses.replace(agent, tokens_used=99), [make_step(stale, 1)])
    assert [r.id for r in await store.list_runs(agent.id, before=None, limit=10)] == [first.id]
    stored = await store.get_agent(agent.id)
    assert stored is not None and stored.tokens_used == agent.tokens_used


async def test_many_agents_writing_at_once_are_all_stored(store: SqlAgentStore) -> None:
    # Concurrent writes go to the database together; each stays its own.
    agents = [make_agent() for _ in range(40)]
    for agent in agents:
        await store.add_agent(agent)
    runs = [make_run(agent) for agent in agents]
    steps = {run.id: [make_step(run, i) for i in (1, 2)] for run in runs}
    await asyncio.gather(
        *[
            store.begin_run(run, dataclasses.replace(agent, state=AgentState.RUNNING), steps[run.id][:1])
            for agent, run in zip(agents, runs, strict=True)
        ]
    )
    rival = make_step(runs[0], 2, ChatMessage(role=Role.ASSISTANT, content="rival"))
    outcomes = await asyncio.gather(
        *[store.append_step(steps[run.id][1]) for run in runs],
        store.append_step(rival),
        return_exceptions=True,
    )
    assert [type(o).__name__ for o in outcomes] == ["NoneType"] * len(runs) + ["DuplicateStep"]
    for agent, run in zip(agents, runs, strict=True):
        assert await store.list_steps(agent.session_id, after_sequence=0, limit=10) == steps[run.id]
        assert await store.list_runs(agent.id, before=None, limit=10) == [run]
        stored = await store.get_agent(agent.id)
        assert stored is not None and stored.state is AgentState.RUNNING


async def test_list_runs_newest_first_before_a_cursor(store: SqlAgentStore) -> None:
    agent = make_agent()
    other = make_agent()
    ids = sorted(uuid7() for _ in range(5))
    for run_id in ids:
        await store.add_run(make_run(agent, id=run_id))
    await store.add_run(make_run(other))

    newest = await store.list_runs(agent.id, before=None, limit=2)
    assert [r.id for r in newest] == [ids[4], ids[3]]
    older = await store.list_runs(agent.id, before=newest[-1].id, limit=2)
    assert [r.id for r in older] == [ids[2], ids[1]]
    oldest = await store.list_runs(agent.id, before=older[-1].id, limit=2)
    assert [r.id for r in oldest] == [ids[0]]
    assert await store.list_runs(agent.id, before=ids[0], limit=2) == []
    assert await store.list_runs(uuid.uuid4(), before=None, limit=2) == []


async def test_the_running_run_is_found_by_its_status_not_as_the_newest(store: SqlAgentStore) -> None:
    agent = make_agent()
    earlier, later = sorted(uuid7() for _ in range(2))
    # The later id: a run begun and ended by a replica whose clock runs ahead.
    await store.add_run(make_run(agent, id=later, status=RunStatus.COMPLETED, ended_at=now()))
    assert await store.running_run(agent.id) is None
    await store.add_run(make_run(agent, id=earlier))
    found = await store.running_run(agent.id)
    assert found is not None and found.id == earlier


# Steps


async def test_steps_round_trip_every_field(store: SqlAgentStore) -> None:
    run = make_run(make_agent())
    messages = [
        ChatMessage(role=Role.SYSTEM, content="系统提示"),
        ChatMessage(role=Role.USER, content="", name="alice 👩"),
        ChatMessage(
            role=Role.ASSISTANT,
            content=None,
            reasoning="Let me think… 🤔",
            tool_calls=(
                ToolCall(id="call_1", name="send_message", arguments='{"text": "你好", "n": 1}'),
                ToolCall(id="call_2", name="noop", arguments="{}"),
            ),
        ),
        ChatMessage(role=Role.TOOL, content='{"ok": true}', tool_call_id="call_1", name="send_message"),
        ChatMessage(role=Role.ASSISTANT, content="done", reasoning=""),
    ]
    metrics = StepMetrics(
        duration_ms=1234.5,
        first_token_ms=87.25,
        input_tokens=3_000_000_000,
        output_tokens=42,
        cached_tokens=1024,
        model="gpt-x-2026",
        tool_duration_ms=0.125,
    )
    stored = [
        make_step(run, i, m, metrics=metrics if m.role is Role.ASSISTANT else StepMetrics())
        for i, m in enumerate(messages, start=1)
    ]
    for step in stored:
        await store.append_step(step)

    got = await store.list_steps(run.session_id, after_sequence=0, limit=100)
    assert got == stored
    assert got[0].created_at.tzinfo is UTC
    assert await store.last_sequence(run.session_id) == len(messages)


async def test_a_taken_sequence_is_refused_and_the_next_append_works(store: SqlAgentStore) -> None:
    run = make_run(make_agent())
    first = make_step(run, 1)
    await store.append_step(first)

    stale = make_step(run, 1, ChatMessage(role=Role.USER, content="late"))
    with pytest.raises(DuplicateStep):
        await store.append_step(stale)
    with pytest.raises(DuplicateStep):
        await store.append_step(stale)

    second = make_step(run, 2)
    await store.append_step(second)
    assert await store.list_steps(run.session_id, after_sequence=0, limit=10) == [first, second]
    assert await store.last_sequence(run.session_id) == 2
    # Sequences belong to a session: another session may use 1.
    elsewhere = make_run(make_agent())
    await store.append_step(make_step(elsewhere, 1))


async def test_last_sequence_of_a_new_session_is_zero(store: SqlAgentStore) -> None:
    assert await store.last_sequence(uuid.uuid4()) == 0


async def test_list_steps_after_a_sequence_with_a_limit_and_a_run(store: SqlAgentStore) -> None:
    agent = make_agent()
    first_run, second_run = make_run(agent), make_run(agent)
    stored = [make_step(first_run if i <= 3 else second_run, i) for i in range(1, 7)]
    # Appended out of order: reads order by sequence.
    for step in reversed(stored):
        await store.append_step(step)
    await store.append_step(make_step(make_run(make_agent()), 1))

    session = agent.session_id
    assert await store.list_steps(session, after_sequence=0, limit=100) == stored
    assert await store.list_steps(session, after_sequence=2, limit=2) == stored[2:4]
    assert await store.list_steps(session, after_sequence=6, limit=10) == []
    assert await store.list_steps(session, after_sequence=0, limit=10, run_id=second_run.id) == stored[3:]
    assert await store.list_steps(session, after_sequence=4, limit=1, run_id=second_run.id) == stored[4:5]
    assert await store.list_steps(session, after_sequence=0, limit=10, run_id=uuid.uuid4()) == []
    assert await store.list_steps(uuid.uuid4(), after_sequence=0, limit=10) == []


@pytest.mark.parametrize("writers", ["one store", "two stores"])
async def test_concurrent_appends_of_one_sequence_have_one_winner(
    store: SqlAgentStore, runtime_url: str, writers: str
) -> None:
    other = SqlAgentStore(Database(runtime_url)) if writers == "two stores" else store
    try:
        run = make_run(make_agent())
        rivals = [make_step(run, 1, ChatMessage(role=Role.ASSISTANT, content=f"rival {i}")) for i in range(2)]
        outcomes = await asyncio.gather(
            store.append_step(rivals[0]), other.append_step(rivals[1]), return_exceptions=True
        )
        assert sorted(type(o).__name__ for o in outcomes) == ["DuplicateStep", "NoneType"]
        winner = rivals[outcomes.index(None)]
        assert await store.list_steps(run.session_id, after_sequence=0, limit=10) == [winner]
        # Both stores go on writing.
        await other.append_step(make_step(run, 2))
        await store.append_step(make_step(run, 3))
        assert await store.last_sequence(run.session_id) == 3
    finally:
        if other is not store:
            await other.aclose()


# Database and migrations


async def test_ping_and_idempotent_close(runtime_url: str) -> None:
    database = Database(runtime_url)
    assert await database.ping()
    store = SqlAgentStore(database)
    await store.aclose()
    await store.aclose()


def _differences(connection: Connection) -> list[Any]:
    is_postgres = connection.dialect.name == "postgresql"
    context = MigrationContext.configure(
        connection,
        opts={
            "version_table": "runtime_alembic_version",
            "version_table_schema": SCHEMA if is_postgres else None,
            "include_schemas": is_postgres,
            # Only the runtime's schema (the IM's shares the database); SQLite has just one.
            "include_name": lambda name, kind, _parent: kind != "schema" or name == SCHEMA or not is_postgres,
            "compare_type": True,
        },
    )
    if is_postgres:
        target = metadata
    else:
        target = sa.MetaData()
        for table in metadata.tables.values():
            # None takes the target's schema (none), as documented; the annotation omits it.
            table.to_metadata(target, schema=None)  # type: ignore[arg-type]
    return list(compare_metadata(context, target))


async def test_the_migrations_build_exactly_the_tables(runtime_url: str) -> None:
    database = Database(runtime_url)
    try:
        async with database.engine.connect() as conn:
            assert await conn.run_sync(_differences) == []
    finally:
        await database.aclose()


async def test_downgrade_and_upgrade_again(runtime_url: str) -> None:
    database = Database(runtime_url)
    if not database.is_sqlite:
        await database.aclose()
        pytest.skip("PostgreSQL tests share one migrated schema")
    try:
        await migrate.downgrade(database, "base")
        async with database.engine.connect() as conn:
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
        assert set(names) == {"runtime_alembic_version"}
        await migrate.upgrade(database)
        store = SqlAgentStore(database)
        agent = make_agent()
        await store.add_agent(agent)
        assert await store.get_agent(agent.id) == agent
    finally:
        await database.aclose()


async def test_watch_cursors_are_saved_and_replaced(store: SqlAgentStore) -> None:
    one, two = uuid.uuid4(), uuid.uuid4()
    await store.save_watch_cursors({one: "12", two: "7"})
    await store.save_watch_cursors({one: "15"})
    await store.save_watch_cursors({})
    cursors = await store.watch_cursors()
    assert cursors[one] == "15" and cursors[two] == "7"


# History: sessions, checkpoints, the step archive


async def _agent_with_steps(store: SqlAgentStore, count: int, **fields: Any) -> tuple[Agent, Run]:
    agent = make_agent(**fields)
    await store.add_agent(agent)
    await store.add_session(Session(id=agent.session_id, agent_id=agent.id, created_at=agent.created_at))
    run = make_run(agent)
    await store.add_run(run)
    for sequence in range(1, count + 1):
        await store.append_step(make_step(run, sequence))
    return agent, run


async def _contents(store: SqlAgentStore, session_id: uuid.UUID) -> list[tuple[int, str | None]]:
    found = await store.list_steps(session_id, after_sequence=0, limit=100)
    return [(s.sequence, s.message.content) for s in found]


async def test_sessions_are_listed_oldest_first_with_their_step_counts(store: SqlAgentStore) -> None:
    agent, _ = await _agent_with_steps(store, 3)
    main = Session(id=agent.session_id, agent_id=agent.id, created_at=agent.created_at)
    await store.add_session(main)  # again: no change, no error
    other = Session(
        id=uuid7(), agent_id=agent.id, created_at=now(), forked_from=main.id, forked_at_sequence=2
    )
    await store.add_session(other)
    assert await store.get_session(other.id) == other
    assert await store.get_session(uuid.uuid4()) is None
    assert await store.list_sessions(agent.id) == [(main, 3), (other, 0)]
    await store.set_main_session(agent.id, other.id)
    stored = await store.get_agent(agent.id)
    assert stored is not None and stored.session_id == other.id


async def test_a_fork_copies_the_steps_up_to_its_sequence(store: SqlAgentStore) -> None:
    agent, run = await _agent_with_steps(store, 2)
    await store.append_step(make_step(run, 3, interrupted=True))
    await store.append_step(make_step(run, 4))
    fork = Session(
        id=uuid7(), agent_id=agent.id, created_at=now(), forked_from=agent.session_id, forked_at_sequence=3
    )
    assert await store.fork_session(fork) == 3
    assert await store.get_session(fork.id) == fork
    original = await store.list_steps(agent.session_id, after_sequence=0, limit=10)
    copies = await store.list_steps(fork.id, after_sequence=0, limit=10)
    assert [s.sequence for s in copies] == [1, 2, 3] and len(original) == 4
    for copy, source in zip(copies, original, strict=False):
        assert copy.id != source.id and copy.session_id == fork.id
        assert dataclasses.replace(copy, id=source.id, session_id=source.session_id).message == source.message
    # The copies keep the interrupted mark (archived with it when they go).
    assert await store.archive_steps(fork.id, reason="retried", at=now(), sequences=[3]) == 1
    ((reason, archived),) = await store.archived_steps(fork.id)
    assert reason == "retried" and archived.interrupted and archived.sequence == 3


async def test_a_clone_s_empty_main_session_becomes_the_fork(store: SqlAgentStore) -> None:
    agent, _ = await _agent_with_steps(store, 2)
    clone, _ = await _agent_with_steps(store, 0)
    fork = Session(
        id=clone.session_id,
        agent_id=clone.id,
        created_at=clone.created_at,
        forked_from=agent.session_id,
        forked_at_sequence=2,
    )
    assert await store.fork_session(fork) == 2
    assert await store.list_sessions(clone.id) == [(fork, 2)]
    copies = await store.list_steps(clone.session_id, after_sequence=0, limit=10)
    assert all(s.agent_id == clone.id for s in copies)
    assert await _contents(store, agent.session_id) == [(1, "step 1"), (2, "step 2")]


async def test_an_edit_archives_the_original_in_the_same_change(store: SqlAgentStore) -> None:
    agent, _ = await _agent_with_steps(store, 2)
    (first, _) = await store.list_steps(agent.session_id, after_sequence=0, limit=10)
    assert await store.edit_step(first.id, "corrected", at=now())
    assert not await store.edit_step(uuid.uuid4(), "nothing", at=now())
    edited = (await store.list_steps(agent.session_id, after_sequence=0, limit=1))[0]
    assert edited.id == first.id and edited.message.content == "corrected"
    assert edited.message.role is first.message.role
    ((reason, original),) = await store.archived_steps(agent.session_id)
    assert reason == "edited" and original == first


async def test_steps_are_archived_by_number_or_after_one(store: SqlAgentStore) -> None:
    agent, _ = await _agent_with_steps(store, 6)
    at = now()
    assert await store.archive_steps(agent.session_id, reason="deleted", at=at, sequences=[2, 3]) == 2
    assert (
        await store.archive_steps(
            agent.session_id, reason="retried", at=at + timedelta(seconds=1), after_sequence=4
        )
        == 2
    )
    assert await store.archive_steps(agent.session_id, reason="deleted", at=at, sequences=[2]) == 0
    assert await _contents(store, agent.session_id) == [(1, "step 1"), (4, "step 4")]
    archived = await store.archived_steps(agent.session_id)
    assert [(reason, s.sequence) for reason, s in archived] == [
        ("deleted", 2),
        ("deleted", 3),
        ("retried", 5),
        ("retried", 6),
    ]
    # A sequence number freed by the archive may be written again.
    run = make_run(agent)
    await store.append_step(make_step(run, 5, ChatMessage(role=Role.ASSISTANT, content="again")))
    assert (await _contents(store, agent.session_id))[-1] == (5, "again")


async def test_checkpoints_keep_settings_list_newest_first_and_restore(store: SqlAgentStore) -> None:
    agent, _ = await _agent_with_steps(
        store,
        4,
        name="ada",
        role="helper",
        system_prompt="Be kind.",
        model=ModelSettings(model="m1", base_url="http://x", temperature=0.5, max_tokens=None),
        tools=("send_message",),
        token_budget=500,
    )
    made = []
    for index in range(3):
        checkpoint = Checkpoint(
            id=uuid7(),
            agent_id=agent.id,
            name=f"c{index}",
            session_id=agent.session_id,
            sequence=2 + index,
            settings=dataclasses.replace(agent, system_prompt=f"prompt {index}"),
            created_at=now(),
        )
        await store.add_checkpoint(checkpoint)
        made.append(checkpoint)
    # Settings changed since: a checkpoint keeps its own.
    await store.update_agent(dataclasses.replace(agent, name="renamed", system_prompt="Be terse.", tools=()))
    found = await store.get_checkpoint(made[0].id)
    assert found is not None and found.settings.system_prompt == "prompt 0"
    assert (found.settings.name, found.settings.tools, found.settings.model) == (
        "ada",
        ("send_message",),
        agent.model,
    )
    assert found.settings.token_budget == 500 and found.settings.id == agent.id
    assert dataclasses.replace(found, settings=made[0].settings) == made[0]
    assert await store.get_checkpoint(uuid.uuid4()) is None
    first = await store.list_checkpoints(agent.id, before=None, limit=2)
    rest = await store.list_checkpoints(agent.id, before=first[-1].id, limit=2)
    assert [c.name for c in first + rest] == ["c2", "c1", "c0"]

    elsewhere = uuid7()
    await store.set_main_session(agent.id, elsewhere)
    assert await store.restore_checkpoint(made[0], at=now()) == 2
    assert await _contents(store, agent.session_id) == [(1, "step 1"), (2, "step 2")]
    assert [r for r, _ in await store.archived_steps(agent.session_id)] == ["restored", "restored"]
    restored = await store.get_agent(agent.id)
    assert restored is not None and restored.session_id == agent.session_id


async def test_the_migration_gives_every_existing_agent_its_main_session(runtime_url: str) -> None:
    database = Database(runtime_url)
    if not database.is_sqlite:
        await database.aclose()
        pytest.skip("PostgreSQL tests share one migrated schema")
    try:
        await migrate.downgrade(database, "0002")
        store = SqlAgentStore(database)
        agent = make_agent()
        # As revision 0002 stored an agent: without the columns added since.
        added_since = {"pause_pending", "auto_recall", "context_tokens", "state_version", "owner_id"}
        row = {c.name: v for c, v in agent_row(agent).items() if c.name not in added_since}
        async with database.engine.begin() as conn:
            await conn.execute(agents.insert().values(**row))
        await migrate.upgrade(database)
        (session, count) = (await store.list_sessions(agent.id))[0]
        assert (session.id, session.agent_id, session.forked_from, count) == (
            agent.session_id,
            agent.id,
            None,
            0,
        )
        # Made before owners were kept: it has none (admins control it).
        upgraded = await store.get_agent(agent.id)
        assert upgraded is not None and upgraded.owner_id is None
    finally:
        await database.aclose()


# Tasks


def make_task(agent_id: uuid.UUID, **fields: Any) -> Task:
    values: dict[str, Any] = {
        "id": uuid7(),
        "agent_id": agent_id,
        "session_id": uuid7(),
        "input": "do it",
        "status": TaskStatus.QUEUED,
        "created_at": now(),
    }
    values.update(fields)
    return Task(**values)


async def test_the_reconciles_look_for_waiting_and_running_tasks_by_index_not_through_every_task(
    runtime_url: str,
) -> None:
    """Every replica looks for waiting and running tasks across all agents at
    each reconcile; finished tasks pile up for good, so those statements must
    be able to use the partial indexes of the few waiting and running ones,
    also in a prepared statement's generic plan (which knows no parameter)."""
    database = Database(runtime_url)
    store = SqlAgentStore(database)
    try:
        agent_id = uuid7()
        for status in (TaskStatus.SUCCEEDED, TaskStatus.DEAD, TaskStatus.CANCELLED, TaskStatus.QUEUED):
            await store.add_task(make_task(agent_id, status=status))
        statements: list[tuple[str, Any]] = []

        def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
            statements.append((statement, parameters))

        sa.event.listen(database.engine.sync_engine, "before_cursor_execute", record)
        try:
            assert agent_id in await store.agents_with_waiting_tasks()
            waiting = statements[-1]
            await store.running_tasks()
            running = statements[-1]
        finally:
            sa.event.remove(database.engine.sync_engine, "before_cursor_execute", record)
        assert "ix_tasks_waiting" in await _plan(database, *waiting)
        assert "ix_tasks_running" in await _plan(database, *running)
    finally:
        await store.aclose()


async def _plan(database: Database, statement: str, parameters: Any) -> str:
    """The plan of a statement as the store sent it: on PostgreSQL generic
    (as a prepared statement's plan turns after five runs) and with scans of
    whole tables priced out, so that an index that can serve it shows."""
    async with database.engine.connect() as conn:
        if database.is_sqlite:
            rows = await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            return "\n".join(str(row[-1]) for row in rows)
        await conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        await conn.exec_driver_sql("SET enable_seqscan = off")
        # EXPLAIN of the statement itself would plan it for these values.
        name = f"reconcile_{uuid.uuid4().hex}"
        await conn.exec_driver_sql(f"PREPARE {name} AS {statement}")
        values = ", ".join("'" + str(value).replace("'", "''") + "'" for value in parameters)
        explain = f"EXPLAIN EXECUTE {name}({values})" if values else f"EXPLAIN EXECUTE {name}"
        plan = "\n".join(str(row[0]) for row in await conn.exec_driver_sql(explain))
        await conn.exec_driver_sql(f"DEALLOCATE {name}")
        await conn.rollback()
        return plan


async def test_a_task_round_trips_every_field_and_its_progress_is_replaced(store: SqlAgentStore) -> None:
    agent_id = uuid7()
    task = make_task(agent_id, input="write the report ✍", priority=-3, request_id="r-1")
    assert await store.add_task(task) == task
    assert await store.get_task(task.id) == task
    assert await store.get_task(uuid.uuid4()) is None
    at = now()
    progressed = dataclasses.replace(
        task,
        status=TaskStatus.FAILED,
        attempts=2,
        last_error="boom",
        result="half",
        started_at=at,
        ended_at=at + timedelta(seconds=1),
        retry_at=at + timedelta(seconds=5),
        run_id=uuid7(),
        # What a task was submitted with never changes.
        input="changed",
        priority=7,
    )
    assert await store.update_task(progressed, expected=[TaskStatus.QUEUED])
    stored = await store.get_task(task.id)
    assert stored == dataclasses.replace(progressed, input=task.input, priority=task.priority)
    # A compare-and-set: the stored status must be one expected.
    assert not await store.update_task(
        dataclasses.replace(task, status=TaskStatus.RUNNING), expected=[TaskStatus.QUEUED]
    )
    assert await store.get_task(task.id) == stored


async def test_a_request_id_is_recorded_once_per_agent(store: SqlAgentStore, runtime_url: str) -> None:
    agent_id = uuid7()
    first = make_task(agent_id, request_id="same")
    assert await store.add_task(first) == first
    assert await store.add_task(make_task(agent_id, request_id="same", input="other")) == first
    assert await store.find_task(agent_id, "same") == first
    assert await store.find_task(agent_id, "other") is None
    # Other agents' request_ids, and tasks without one, are independent.
    elsewhere = make_task(uuid7(), request_id="same")
    assert await store.add_task(elsewhere) == elsewhere
    plain = [make_task(agent_id) for _ in range(2)]
    assert [await store.add_task(t) for t in plain] == plain
    assert await store.find_task(agent_id, "") is None
    # Concurrent submissions through two stores: one task.
    other = SqlAgentStore(Database(runtime_url))
    try:
        rivals = [make_task(agent_id, request_id="raced", input=f"rival {i}") for i in range(6)]
        stored = await asyncio.gather(
            *(s.add_task(t) for s, t in zip([store, other] * 3, rivals, strict=True))
        )
        assert len({t.id for t in stored}) == 1 and stored[0] in rivals
    finally:
        await other.aclose()


async def test_task_writes_arriving_together_each_stand_or_fall_alone(
    store: SqlAgentStore, runtime_url: str
) -> None:
    # Concurrent task writes share a journal batch (one transaction, or one statement).
    agent_id, workspace_id = uuid7(), uuid7()
    waiting = make_task(agent_id, request_id="first")
    assert await store.add_task(waiting) == waiting

    def submitted(task: Task) -> audit.AuditRecord:
        target = audit.Target("task", str(task.id))
        return audit.succeeded(None, workspace_id=workspace_id, action="SubmitTask", target=target, at=now())

    fresh = [make_task(agent_id, request_id=f"new-{i}", input=f"new {i}") for i in range(4)]
    again = make_task(agent_id, request_id="first", input="a retry")
    at = now()
    started = dataclasses.replace(waiting, status=TaskStatus.RUNNING, attempts=1, started_at=at)
    cancelled = dataclasses.replace(waiting, status=TaskStatus.CANCELLED, ended_at=at)
    results = await asyncio.gather(
        *(store.add_task(t, audit=submitted(t)) for t in fresh),
        store.add_task(again, audit=submitted(again)),
        # A runner starting the task and a person cancelling it: one wins.
        store.update_task(started, expected=[TaskStatus.QUEUED, TaskStatus.FAILED]),
        store.update_task(cancelled, expected=[TaskStatus.QUEUED, TaskStatus.FAILED]),
    )
    assert list(results[:4]) == fresh
    replayed = results[4]
    assert isinstance(replayed, Task) and replayed.id == waiting.id  # the request id's task, not the retry
    assert sorted(bool(r) for r in results[5:]) == [False, True]
    stored = await store.get_task(waiting.id)
    assert stored in (started, cancelled)
    assert [await store.get_task(t.id) for t in fresh] == fresh
    # The audit records of the tasks stored, and none of the retry that stored nothing.
    database = Database(runtime_url)
    try:
        async with database.engine.connect() as conn:
            rows = await conn.execute(
                sa.select(audit_events.c.target_id, audit_events.c.action).where(
                    audit_events.c.workspace_id == workspace_id
                )
            )
            recorded = sorted(rows.all())
    finally:
        await database.aclose()
    assert recorded == sorted((str(t.id), "SubmitTask") for t in fresh)


async def test_tasks_are_listed_newest_first_before_a_cursor(store: SqlAgentStore) -> None:
    agent_id = uuid7()
    tasks_ = [make_task(agent_id, input=f"t{i}") for i in range(5)]
    for task in tasks_:
        await store.add_task(task)
    await store.add_task(make_task(uuid7()))
    first = await store.list_tasks(agent_id, before=None, limit=3)
    rest = await store.list_tasks(agent_id, before=first[-1].id, limit=3)
    assert [t.input for t in first + rest] == ["t4", "t3", "t2", "t1", "t0"]


async def test_the_queue_is_served_by_priority_then_arrival(store: SqlAgentStore) -> None:
    agent_id, start = uuid7(), now()
    at = [start + timedelta(milliseconds=i) for i in range(10)]
    low = make_task(agent_id, input="low", created_at=at[0])
    high = make_task(agent_id, input="high", priority=5, created_at=at[1])
    high_later = make_task(agent_id, input="high later", priority=5, created_at=at[2])
    # Submitted in the same instant: the id breaks the tie.
    twin_a, twin_b = sorted(
        [make_task(agent_id, input="twin", created_at=at[3]) for _ in range(2)], key=lambda t: t.id
    )
    due = make_task(agent_id, input="due retry", priority=5, created_at=at[4])
    later = make_task(agent_id, input="later retry", priority=9, created_at=at[0])
    others = [
        make_task(agent_id, input=status.value, priority=99, status=status)
        for status in (TaskStatus.RUNNING, TaskStatus.SUCCEEDED, TaskStatus.CANCELLED, TaskStatus.DEAD)
    ]
    for task in [low, high, high_later, twin_b, twin_a, due, later, *others, make_task(uuid7(), priority=99)]:
        await store.add_task(task)
    for task, retry in ((due, start), (later, start + timedelta(hours=1))):
        failed = dataclasses.replace(task, status=TaskStatus.FAILED, attempts=1, retry_at=retry)
        assert await store.update_task(failed, expected=[TaskStatus.QUEUED])
    clock = start + timedelta(seconds=1)
    order = [high, high_later, due, low, twin_a, twin_b]
    assert [await store.tasks_ahead(t, now=clock) for t in order] == [0, 1, 2, 3, 4, 5]
    assert await store.next_retry_at(agent_id) == start
    served: list[uuid.UUID] = []
    while (head := await store.next_task(agent_id, now=clock)) is not None:
        served.append(head.id)
        await store.update_task(
            dataclasses.replace(head, status=TaskStatus.SUCCEEDED), expected=[head.status]
        )
    assert served == [t.id for t in order]
    # Once its retry is due, the later one comes first (priority 9).
    assert await store.next_retry_at(agent_id) == start + timedelta(hours=1)
    head = await store.next_task(agent_id, now=start + timedelta(hours=1))
    assert head is not None and head.id == later.id
    assert await store.next_task(uuid7(), now=clock) is None
    assert await store.next_retry_at(uuid7()) is None


async def test_cancelling_the_waiting_tasks_of_an_agent(store: SqlAgentStore) -> None:
    agent_id, at = uuid7(), now()
    queued = [make_task(agent_id) for _ in range(3)]
    failed = make_task(agent_id, status=TaskStatus.FAILED, retry_at=at)
    running = make_task(agent_id, status=TaskStatus.RUNNING)
    elsewhere = make_task(uuid7())
    for task in [*queued, failed, running, elsewhere]:
        await store.add_task(task)
    cancelled = await store.cancel_waiting_tasks(agent_id, at=at)
    expected = [
        dataclasses.replace(t, status=TaskStatus.CANCELLED, ended_at=at, retry_at=None)
        for t in [*queued, failed]
    ]
    assert cancelled == sorted(expected, key=lambda t: t.id)
    assert [await store.get_task(t.id) for t in [*queued, failed]] == expected
    assert await store.get_task(running.id) == running and await store.get_task(elsewhere.id) == elsewhere
    assert await store.cancel_waiting_tasks(agent_id, at=at) == []


async def test_queue_stats(store: SqlAgentStore) -> None:
    agent_id, start = uuid7(), now()
    assert await store.queue_stats(agent_id) == (0, 0, 0.0)
    tasks_ = [
        make_task(agent_id, created_at=start),
        make_task(
            agent_id, status=TaskStatus.FAILED, created_at=start, started_at=start + timedelta(seconds=1)
        ),
        make_task(
            agent_id, status=TaskStatus.RUNNING, created_at=start, started_at=start + timedelta(seconds=3)
        ),
        make_task(
            agent_id, status=TaskStatus.SUCCEEDED, created_at=start, started_at=start + timedelta(seconds=2)
        ),
        make_task(agent_id, status=TaskStatus.CANCELLED, created_at=start),
        make_task(
            uuid7(), status=TaskStatus.RUNNING, created_at=start, started_at=start + timedelta(hours=1)
        ),
    ]
    for task in tasks_:
        await store.add_task(task)
    waiting, running, average = await store.queue_stats(agent_id)
    assert (waiting, running) == (2, 1)
    assert average == pytest.approx(2000.0, abs=1.0)


async def test_many_tasks_with_request_ids_keep_using_the_unique_index(store: SqlAgentStore) -> None:
    # PostgreSQL plans a prepared statement generically after five runs on a
    # connection; ON CONFLICT must still find the partial unique index then.
    agent_id = uuid7()
    first = [await store.add_task(make_task(agent_id, request_id=f"r-{i}")) for i in range(12)]
    assert len({t.id for t in first}) == 12
    again = [await store.add_task(make_task(agent_id, request_id=f"r-{i}")) for i in range(12)]
    assert [t.id for t in again] == [t.id for t in first]
