"""The task queue over gRPC: SubmitTask, GetTask, ListTasks, CancelTask and
GetQueueStats on a running runtime with a real IM service, and tasks run by
the agents' runners (the offline model, or a scripted OpenAI-compatible fake)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, World, make_world
from tests.fake_openai import FakeOpenAI, Reply, chunk, text_reply
from tests.integration.test_runtime_grpc import RunningRuntime, create_agent, start_runtime, stop_runtime

WAIT = 15.0
Start = Callable[..., Awaitable[RunningRuntime]]


@pytest.fixture
async def start(im: RunningIM, tmp_path: Path) -> AsyncIterator[Start]:
    """Starts runtimes (with extra settings) on fresh databases; stops them after."""
    started: list[RunningRuntime] = []

    async def starting(**overrides: str) -> RunningRuntime:
        running = await start_runtime(im.address, tmp_path / f"runtime{len(started)}.db", **overrides)
        started.append(running)
        return running

    yield starting
    for running in started:
        await stop_runtime(running)


@pytest.fixture
async def llm() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.stop()


async def refused(call: Awaitable[Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    code: grpc.StatusCode = caught.value.code()
    return code


async def paused_agent(runtime: RunningRuntime, world: World, name: str = "ada") -> rpb.Agent:
    """An agent that takes no task until resumed: its queue stays as submitted."""
    agent = await create_agent(runtime, world, name)
    await runtime.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=world.md(0))
    # A cycle that began before the pause (its first look) ends before any task is submitted.
    runner = runtime.app.runner(uuid.UUID(agent.id))
    assert runner is not None
    await asyncio.wait_for(runner.idle.wait(), WAIT)
    return agent


async def submit(
    runtime: RunningRuntime, world: World, agent: rpb.Agent, text: str, **fields: Any
) -> rpb.Task:
    response = await runtime.stub.SubmitTask(
        rpb.SubmitTaskRequest(agent_id=agent.id, input=text, **fields), metadata=world.md(0)
    )
    return response.task


async def task_events(
    watch: Any, until: Callable[[list[rpb.Task]], bool], *, seconds: float = WAIT
) -> list[rpb.Task]:
    """The task_changed events of a watch until `until(events so far)`."""
    seen: list[rpb.Task] = []

    async def read() -> None:
        while not until(seen):
            response = await watch.read()
            if response.event.WhichOneof("event") == "task_changed":
                seen.append(response.event.task_changed)

    await asyncio.wait_for(read(), seconds)
    return seen


async def test_refusals_have_their_status_codes(im: RunningIM, start: Start) -> None:
    runtime = await start(RUNTIME_MAX_TASK_INPUT_BYTES="100")
    world = await make_world(im.stub, people=1)
    stranger = await make_world(im.stub, people=1)
    ada = await paused_agent(runtime, world)
    stub, md = runtime.stub, world.md(0)
    task = await submit(runtime, world, ada, "report", request_id="r-1")
    code = grpc.StatusCode

    def submitting(metadata: Any = md, **fields: Any) -> Awaitable[Any]:
        request = {"agent_id": ada.id, "input": "do it", **fields}
        return stub.SubmitTask(rpb.SubmitTaskRequest(**request), metadata=metadata)

    assert await refused(submitting(metadata=())) == code.UNAUTHENTICATED
    assert await refused(submitting(metadata=stranger.md(0))) == code.NOT_FOUND
    assert await refused(submitting(agent_id="nope")) == code.INVALID_ARGUMENT
    assert await refused(submitting(agent_id="0" * 8 + "-0000-7000-8000-" + "0" * 12)) == code.NOT_FOUND
    assert await refused(submitting(input="")) == code.INVALID_ARGUMENT
    assert await refused(submitting(input="x" * 101)) == code.INVALID_ARGUMENT
    assert await refused(submitting(session_id="nope")) == code.INVALID_ARGUMENT
    assert await refused(submitting(session_id=task.id)) == code.NOT_FOUND
    assert await refused(submitting(input="another report", request_id="r-1")) == code.ALREADY_EXISTS
    get = stub.GetTask
    assert await refused(get(rpb.GetTaskRequest(task_id="nope"), metadata=md)) == code.INVALID_ARGUMENT
    assert await refused(get(rpb.GetTaskRequest(task_id=ada.id), metadata=md)) == code.NOT_FOUND
    assert await refused(get(rpb.GetTaskRequest(task_id=task.id), metadata=stranger.md(0))) == code.NOT_FOUND
    listing = rpb.ListTasksRequest(agent_id=ada.id, page_token="junk")
    assert await refused(stub.ListTasks(listing, metadata=md)) == code.INVALID_ARGUMENT
    stats = rpb.GetQueueStatsRequest(agent_id=ada.id)
    assert await refused(stub.GetQueueStats(stats, metadata=stranger.md(0))) == code.NOT_FOUND
    cancelled = await stub.CancelTask(rpb.CancelTaskRequest(task_id=task.id), metadata=md)
    assert cancelled.task.status == rpb.TASK_STATUS_CANCELLED
    again = stub.CancelTask(rpb.CancelTaskRequest(task_id=task.id), metadata=md)
    assert await refused(again) == code.FAILED_PRECONDITION


async def test_queued_tasks_are_idempotent_listed_counted_and_cancelled(im: RunningIM, start: Start) -> None:
    runtime = await start()
    world = await make_world(im.stub, people=1)
    ada = await paused_agent(runtime, world)
    stub, md = runtime.stub, world.md(0)
    watch = stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id, live_only=True), metadata=md)
    await asyncio.wait_for(watch.wait_for_connection(), WAIT)
    first = await submit(runtime, world, ada, "first", request_id="r-1")
    assert first.status == rpb.TASK_STATUS_QUEUED and first.position == 0 and first.request_id == "r-1"
    assert first.session_id == ada.main_session_id and first.create_time.seconds > 0
    assert await submit(runtime, world, ada, "first", request_id="r-1") == first
    second = await submit(runtime, world, ada, "second")
    urgent = await submit(runtime, world, ada, "urgent", priority=3)
    assert (second.position, urgent.position) == (1, 0)
    got = await stub.GetTask(rpb.GetTaskRequest(task_id=first.id), metadata=md)
    assert got.task.id == first.id and got.task.position == 1

    page = await stub.ListTasks(rpb.ListTasksRequest(agent_id=ada.id, page_size=2), metadata=md)
    rest = await stub.ListTasks(
        rpb.ListTasksRequest(agent_id=ada.id, page_size=2, page_token=page.next_page_token), metadata=md
    )
    listed = [(t.input, t.position) for t in [*page.tasks, *rest.tasks]]
    assert listed == [("urgent", 0), ("second", 2), ("first", 1)] and rest.next_page_token == ""
    stats = await stub.GetQueueStats(rpb.GetQueueStatsRequest(agent_id=ada.id), metadata=md)
    assert (stats.queued, stats.running, stats.average_wait_ms) == (3, False, 0.0)

    cancelled = await stub.CancelTask(rpb.CancelTaskRequest(task_id=second.id), metadata=md)
    assert cancelled.task.status == rpb.TASK_STATUS_CANCELLED and cancelled.task.HasField("end_time")
    stats = await stub.GetQueueStats(rpb.GetQueueStatsRequest(agent_id=ada.id), metadata=md)
    assert stats.queued == 2
    events = await task_events(watch, lambda seen: len(seen) == 4)
    assert [(t.input, t.status) for t in events] == [
        ("first", rpb.TASK_STATUS_QUEUED),
        ("second", rpb.TASK_STATUS_QUEUED),
        ("urgent", rpb.TASK_STATUS_QUEUED),
        ("second", rpb.TASK_STATUS_CANCELLED),
    ]
    watch.cancel()


async def test_terminating_with_the_queue_cleared_cancels_the_waiting_tasks(
    im: RunningIM, start: Start
) -> None:
    runtime = await start()
    world = await make_world(im.stub, people=1)
    ada = await paused_agent(runtime, world)
    bea = await paused_agent(runtime, world, "bea")
    md = world.md(0)
    kept = [await submit(runtime, world, bea, f"kept {i}") for i in range(2)]
    for i in range(3):
        await submit(runtime, world, ada, f"task {i}")
    await runtime.stub.TerminateAgent(
        rpb.TerminateAgentRequest(agent_id=ada.id, queue_policy=rpb.QUEUE_POLICY_CLEAR), metadata=md
    )
    await runtime.stub.TerminateAgent(
        rpb.TerminateAgentRequest(agent_id=bea.id, queue_policy=rpb.QUEUE_POLICY_KEEP), metadata=md
    )
    listed = await runtime.stub.ListTasks(rpb.ListTasksRequest(agent_id=ada.id), metadata=md)
    assert {t.status for t in listed.tasks} == {rpb.TASK_STATUS_CANCELLED}
    # A terminated agent still takes tasks: they wait for StartAgent.
    waiting = await submit(runtime, world, bea, "after")
    assert waiting.status == rpb.TASK_STATUS_QUEUED and waiting.position == 2
    stats = await runtime.stub.GetQueueStats(rpb.GetQueueStatsRequest(agent_id=bea.id), metadata=md)
    assert stats.queued == 3 and [t.status for t in kept] == [rpb.TASK_STATUS_QUEUED] * 2


# With the runner: tasks run.


async def test_fifty_tasks_submitted_at_once_run_one_at_a_time_in_order(im: RunningIM, start: Start) -> None:
    # 101 creating calls (the agent, 50 tasks, 50 retries) at once: past the
    # default burst of 100, which has tests of its own.
    runtime = await start(LIMIT_CREATE_PER_SECOND="0")
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada")
    md = world.md(0)
    watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id, live_only=True), metadata=md)
    await asyncio.wait_for(watch.wait_for_connection(), WAIT)
    submitted = await asyncio.gather(
        *(submit(runtime, world, ada, f"task {i}", request_id=f"r-{i}") for i in range(50))
    )
    # Retried submissions change nothing.
    await asyncio.gather(*(submit(runtime, world, ada, f"task {i}", request_id=f"r-{i}") for i in range(50)))
    assert len({t.id for t in submitted}) == 50

    def all_done(seen: list[rpb.Task]) -> bool:
        return sum(t.status == rpb.TASK_STATUS_SUCCEEDED for t in seen) == 50

    events = await task_events(watch, all_done, seconds=30)
    watch.cancel()
    running: set[str] = set()
    started: list[str] = []
    for task in events:
        if task.status == rpb.TASK_STATUS_RUNNING:
            assert not running, "two tasks ran at once"
            running.add(task.id)
            started.append(task.id)
        elif task.status in (rpb.TASK_STATUS_SUCCEEDED, rpb.TASK_STATUS_FAILED):
            running.discard(task.id)
    arrival = [t.id for t in sorted(submitted, key=lambda t: (t.create_time.ToDatetime(), t.id))]
    assert started == arrival
    listed = await runtime.stub.ListTasks(rpb.ListTasksRequest(agent_id=ada.id, page_size=100), metadata=md)
    assert len(listed.tasks) == 50
    assert all(t.status == rpb.TASK_STATUS_SUCCEEDED and t.attempts == 1 and t.result for t in listed.tasks)
    assert all(t.run_id and t.HasField("start_time") and t.HasField("end_time") for t in listed.tasks)
    stats = await runtime.stub.GetQueueStats(rpb.GetQueueStatsRequest(agent_id=ada.id), metadata=md)
    assert stats.queued == 0 and not stats.running and stats.average_wait_ms > 0
    # Each ran as a run whose first step is its input, in the agent's main session.
    steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=ada.id, page_size=200), metadata=md)
    inputs = [s.content for s in steps.steps if s.role == rpb.STEP_ROLE_USER]
    arrival_inputs = [t.input for t in sorted(submitted, key=lambda t: (t.create_time.ToDatetime(), t.id))]
    assert len(inputs) == 50
    assert all(content.endswith(text) for content, text in zip(inputs, arrival_inputs, strict=True))


async def test_cancelling_a_running_task_cuts_it_short(im: RunningIM, start: Start, llm: FakeOpenAI) -> None:
    runtime = await start(OPENAI_BASE_URL=llm.url, OPENAI_MODEL="fake", LLM_MAX_RETRIES="0")
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada")
    md = world.md(0)
    # The first completion streams a little and then hangs; the next one answers.
    llm.script(Reply(chunks=[chunk(role="assistant", content=""), chunk(content="Work")], hold=True))
    llm.script(text_reply("second done"))
    watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id, live_only=True), metadata=md)
    await asyncio.wait_for(watch.wait_for_connection(), WAIT)
    slow = await submit(runtime, world, ada, "the slow one")
    await task_events(watch, lambda seen: any(t.status == rpb.TASK_STATUS_RUNNING for t in seen))
    queued = await submit(runtime, world, ada, "the next one")
    cancelled = await runtime.stub.CancelTask(rpb.CancelTaskRequest(task_id=slow.id), metadata=md)
    assert cancelled.task.status == rpb.TASK_STATUS_CANCELLED and cancelled.task.HasField("end_time")
    # The agent goes on with the next task.
    events = await task_events(
        watch, lambda seen: any(t.id == queued.id and t.status == rpb.TASK_STATUS_SUCCEEDED for t in seen)
    )
    watch.cancel()
    assert [t.result for t in events if t.status == rpb.TASK_STATUS_SUCCEEDED] == ["second done"]
    got = await runtime.stub.GetTask(rpb.GetTaskRequest(task_id=slow.id), metadata=md)
    assert got.task.status == rpb.TASK_STATUS_CANCELLED and got.task.attempts == 1
    # Its run kept what was streamed, and its history stays valid for the next call.
    agent = await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=ada.id), metadata=md)
    assert agent.agent.state == rpb.AGENT_STATE_IDLE


async def test_a_failing_task_is_retried_then_dead(im: RunningIM, start: Start, llm: FakeOpenAI) -> None:
    # Nothing scripted: every completion is refused.
    runtime = await start(
        OPENAI_BASE_URL=llm.url,
        OPENAI_MODEL="fake",
        LLM_MAX_RETRIES="0",
        RUNTIME_TASK_MAX_ATTEMPTS="3",
        RUNTIME_TASK_RETRY_BASE_SECONDS="0.05",
    )
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada")
    md = world.md(0)
    watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id, live_only=True), metadata=md)
    await asyncio.wait_for(watch.wait_for_connection(), WAIT)
    task = await submit(runtime, world, ada, "doomed")
    events = await task_events(watch, lambda seen: any(t.status == rpb.TASK_STATUS_DEAD for t in seen))
    watch.cancel()
    assert [t.status for t in events] == [
        rpb.TASK_STATUS_QUEUED,
        *[rpb.TASK_STATUS_RUNNING, rpb.TASK_STATUS_FAILED] * 2,
        rpb.TASK_STATUS_RUNNING,
        rpb.TASK_STATUS_DEAD,
    ]
    assert all(t.HasField("retry_time") for t in events if t.status == rpb.TASK_STATUS_FAILED)
    dead = await runtime.stub.GetTask(rpb.GetTaskRequest(task_id=task.id), metadata=md)
    assert dead.task.attempts == 3 and dead.task.last_error and not dead.task.HasField("retry_time")
    assert len(llm.requests) == 3
