"""What the runtime stores so that a crash repeats nothing (issue 8), on
SQLite and PostgreSQL: read marks written with the steps they became, a
pending pause, and the runs and tasks a dead process left running."""

from __future__ import annotations

import dataclasses
import uuid

from uuid_utils.compat import uuid7

from services.runtime.adapters.sql import SqlAgentStore
from services.runtime.domain.errors import DuplicateStep
from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import AgentState, RunStatus, TaskStatus
from tests.integration.test_runtime_store import make_agent, make_run, make_step, make_task, now


async def test_read_marks_move_with_their_steps_and_only_forward(store: SqlAgentStore) -> None:
    agent = make_agent()
    await store.add_agent(agent)
    run = make_run(agent)
    group, other = uuid.uuid4(), uuid.uuid4()
    first, second, third = uuid7(), uuid7(), uuid7()
    user = ChatMessage(role=Role.USER, content="hi")
    await store.begin_run(run, agent, [make_step(run, 1, user)], read_marks={group: second})
    assert await store.read_marks(agent.id) == {group: second}
    await store.append_input(agent.id, [make_step(run, 2, user)], {group: first, other: third})
    assert await store.read_marks(agent.id) == {group: second, other: third}, "never back"
    # Refused with its step: the mark does not move either.
    with_taken_step = [make_step(run, 2, user)]
    try:
        await store.append_input(agent.id, with_taken_step, {other: uuid7()})
    except DuplicateStep:
        pass
    else:
        raise AssertionError("the taken sequence was accepted")
    assert await store.read_marks(agent.id) == {group: second, other: third}
    assert await store.read_marks(uuid.uuid4()) == {}


async def test_a_pending_pause_is_stored_with_the_progress(store: SqlAgentStore) -> None:
    agent = make_agent()
    await store.add_agent(agent)
    pending = dataclasses.replace(agent, state=AgentState.RUNNING, pause_pending=True)
    await store.save_progress(pending)
    stored = await store.get_agent(agent.id)
    assert stored is not None and (stored.state, stored.pause_pending) == (AgentState.RUNNING, True)
    await store.save_progress(dataclasses.replace(pending, state=AgentState.PAUSED, pause_pending=False))
    stored = await store.get_agent(agent.id)
    assert stored is not None and (stored.state, stored.pause_pending) == (AgentState.PAUSED, False)


async def test_running_tasks_come_with_their_runs_or_none(store: SqlAgentStore) -> None:
    agent = make_agent()
    await store.add_agent(agent)
    run = make_run(agent)
    await store.begin_run(run, dataclasses.replace(agent, state=AgentState.RUNNING), [])
    with_run = make_task(agent.id, status=TaskStatus.RUNNING, run_id=run.id)
    without = make_task(agent.id, status=TaskStatus.RUNNING, run_id=uuid7())
    queued = make_task(agent.id)
    elsewhere = make_task(uuid7(), status=TaskStatus.RUNNING, run_id=uuid7())
    for task in (with_run, without, queued, elsewhere):
        await store.add_task(task)
    found = {f.task.id: f for f in await store.running_tasks(agent.id)}
    assert set(found) == {with_run.id, without.id}
    assert found[without.id].run is None
    stored_run = found[with_run.id].run
    assert stored_run is not None and (stored_run.id, stored_run.status) == (run.id, RunStatus.RUNNING)
    assert {f.agent_state for f in found.values()} == {AgentState.RUNNING}
    every = {f.task.id: f for f in await store.running_tasks()}
    assert every[elsewhere.id].agent_state is None, "no such agent"
    assert {with_run.id, without.id, elsewhere.id} <= set(every) and queued.id not in every


async def test_runs_left_running_by_agents_that_are_not_are_ended(store: SqlAgentStore) -> None:
    busy, idle = make_agent(), make_agent()
    for agent in (busy, idle):
        await store.add_agent(agent)
    busy_run, stale_run = make_run(busy), make_run(idle)
    await store.begin_run(busy_run, dataclasses.replace(busy, state=AgentState.RUNNING), [])
    await store.begin_run(stale_run, dataclasses.replace(idle, state=AgentState.RUNNING), [])
    await store.save_progress(dataclasses.replace(idle, state=AgentState.IDLE))
    assert await store.end_stale_runs(error="stopped", at=now()) >= 1
    (ended,) = await store.list_runs(idle.id, before=None, limit=1)
    assert (ended.status, ended.error) == (RunStatus.INTERRUPTED, "stopped") and ended.ended_at is not None
    (kept,) = await store.list_runs(busy.id, before=None, limit=1)
    assert kept.status is RunStatus.RUNNING, "a RUNNING agent's run is its runner's to go on with"


async def test_ending_stale_runs_of_some_agents_leaves_the_others(store: SqlAgentStore) -> None:
    """A replica that gains shards ends the stale runs of their agents only
    (of thousands of them at once: more ids than one statement takes)."""
    mine, others = make_agent(), make_agent()
    stale = {}
    for agent in (mine, others):
        await store.add_agent(agent)
        stale[agent.id] = make_run(agent)
        await store.begin_run(stale[agent.id], dataclasses.replace(agent, state=AgentState.RUNNING), [])
        await store.save_progress(dataclasses.replace(agent, state=AgentState.IDLE))
    ids = [mine.id] + [uuid7() for _ in range(2500)]
    assert await store.end_stale_runs(error="stopped", at=now(), agent_ids=ids) == 1
    (ended,) = await store.list_runs(mine.id, before=None, limit=1)
    assert ended.status is RunStatus.INTERRUPTED
    (kept,) = await store.list_runs(others.id, before=None, limit=1)
    assert kept.status is RunStatus.RUNNING, "another replica's agent"
