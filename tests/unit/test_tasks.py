"""The task queue (`TaskViews`) against in-memory fakes: submission and
idempotency, order and positions, retries, cancellation, statistics."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from services.common import errors
from services.common.identity import Caller
from services.common.outages import DATABASE, DependencyUnavailable
from services.runtime.bootstrap import RuntimeApp
from services.runtime.domain.commands import CancelTask, CreateAgent, SubmitTask
from services.runtime.domain.lifecycle import Control
from services.runtime.domain.model import (
    Agent,
    AgentDraft,
    AgentState,
    Emitted,
    Placed,
    RunStatus,
    Session,
    Task,
    TaskChanged,
    TaskStatus,
)
from services.runtime.service_layer.hub import AgentHub, Watcher
from services.runtime.service_layer.leases import Fence
from services.runtime.service_layer.messagebus import MessageBus
from services.runtime.service_layer.runner import AgentRunner
from services.runtime.service_layer.tasks import WAITING, RetryPolicy, StoredTaskQueue, TaskViews
from tests.identities import caller_of
from tests.unit.runtime_fakes import FakeClock, FakeIM, FakeRunners, InMemoryAgentStore, Script, ScriptedLLM
from tests.unit.runtime_support import fake_runtime, unit_settings

WAIT = 3.0


@dataclass
class Queue:
    """The runtime over fakes (`bootstrap.build`); its runners are `FakeRunners`
    unless the tests run tasks for real."""

    app: RuntimeApp
    im: FakeIM
    store: InMemoryAgentStore
    clock: FakeClock
    me: Caller

    @property
    def hub(self) -> AgentHub:
        return self.app.hub

    @property
    def tasks(self) -> TaskViews:
        return self.app.tasks

    @property
    def bus(self) -> MessageBus:
        return self.app.bus

    @property
    def queue(self) -> StoredTaskQueue:
        return self.app.queue

    @property
    def runners(self) -> FakeRunners:
        assert isinstance(self.app.runners, FakeRunners)
        return self.app.runners

    def runner(self, agent: Agent) -> AgentRunner:
        runner = self.app.runner(agent.id)
        assert runner is not None
        return runner

    async def agent(self, name: str = "ada") -> Agent:
        return await self.bus.handle(CreateAgent(caller=self.me, draft=AgentDraft(name=name)))

    async def submit(self, agent: Agent, text: str = "do it", **fields: object) -> Task:
        submitted = SubmitTask(caller=self.me, agent_id=str(agent.id), text=text, **fields)  # type: ignore[arg-type]
        placed = await self.bus.handle(submitted)
        return placed.task

    async def run_next(self, agent: Agent) -> Task:
        """Takes the head of the queue as a runner would."""
        head = await self.queue.next_task(agent.id, now=self.clock.now)
        assert head is not None
        return await self.queue.started(head, run_id=uuid.uuid4(), at=self.clock())


async def make_queue(
    *, run_tasks: bool = False, jitter: Callable[[], float] = random.random, **settings: Any
) -> AsyncIterator[Queue]:
    """The runtime over fakes, with `settings` changed; its runners run tasks
    only if `run_tasks` (else the tests play the runner)."""
    im, store, clock = FakeIM(), InMemoryAgentStore(), FakeClock()
    app = fake_runtime(
        settings=unit_settings(max_iterations=3, **settings),
        store=store,
        im=im,
        llm=ScriptedLLM(Script(content="done")),
        clock=clock,
        runners=None if run_tasks else FakeRunners(),
        jitter=jitter,
    )
    async with app:
        human = im.human("alice")
        yield Queue(app, im, store, clock, caller_of(human.id, human.workspace_id, roles=("owner",)))


@pytest.fixture
async def q() -> AsyncIterator[Queue]:
    async for value in make_queue(task_max_attempts=3, task_retry_base_seconds=10, task_retry_max_seconds=25):
        yield value


def drain(watcher: Watcher) -> list[tuple[TaskStatus, uuid.UUID]]:
    """The task events the watcher has had so far."""
    seen: list[tuple[TaskStatus, uuid.UUID]] = []
    backlog = watcher._backlog
    while backlog:
        item = backlog.popleft()
        if isinstance(item, Emitted) and isinstance(item.event, TaskChanged):
            seen.append((item.event.task.status, item.event.task.id))
    return seen


# Submission


async def test_a_submitted_task_is_queued_announced_and_wakes_the_agent(q: Queue) -> None:
    ada = await q.agent()
    watcher, _ = q.hub.watch([ada.id])
    placed = await q.bus.handle(
        SubmitTask(caller=q.me, agent_id=str(ada.id), text="summarise the week", priority=2)
    )
    assert q.runners.woken == [ada.id]
    task = placed.task
    assert task.status is TaskStatus.QUEUED and placed.position == 0
    assert task.agent_id == ada.id and task.session_id == ada.session_id
    assert task.input == "summarise the week" and task.priority == 2 and task.attempts == 0
    assert drain(watcher) == [(TaskStatus.QUEUED, task.id)]
    assert (await q.tasks.get_task(q.me, str(task.id))).task == task


async def test_the_same_request_id_returns_the_same_task(q: Queue) -> None:
    ada = await q.agent()
    watcher, _ = q.hub.watch([ada.id])
    first = await q.submit(ada, "report", request_id="r-1", priority=1)
    again = await q.submit(ada, "report", request_id="r-1", priority=1)
    # Naming the main session explicitly asks for the same thing.
    explicit = await q.submit(ada, "report", request_id="r-1", priority=1, session_id=str(ada.session_id))
    assert again == first == explicit
    assert drain(watcher) == [(TaskStatus.QUEUED, first.id)]
    # It keeps answering for the task whatever became of it.
    await q.run_next(ada)
    replay = await q.submit(ada, "report", request_id="r-1", priority=1)
    assert replay.id == first.id and replay.status is TaskStatus.RUNNING
    # Another agent's request_ids are its own.
    bea = await q.agent("bea")
    assert (await q.submit(bea, "report", request_id="r-1")).id != first.id


@pytest.mark.parametrize(
    ("field", "value"), [("text", "another report"), ("priority", 5), ("session_id", "other")]
)
async def test_a_request_id_reused_for_something_else_is_refused(q: Queue, field: str, value: object) -> None:
    ada = await q.agent()
    await q.submit(ada, "report", request_id="r-1", priority=1)
    if value == "other":
        other = Session(id=uuid.uuid4(), agent_id=ada.id, created_at=q.clock())
        await q.store.add_session(other)
        value = str(other.id)
    fields: dict[str, object] = {"text": "report", "priority": 1, field: value}
    with pytest.raises(errors.AlreadyExists, match="r-1"):
        await q.bus.handle(SubmitTask(caller=q.me, agent_id=str(ada.id), request_id="r-1", **fields))  # type: ignore[arg-type]
    assert len(q.store.tasks) == 1


async def test_fifty_concurrent_submissions_are_each_queued_once(q: Queue) -> None:
    ada = await q.agent()
    placed = await asyncio.gather(
        *(
            q.bus.handle(SubmitTask(caller=q.me, agent_id=str(ada.id), text=f"task {i}", request_id=f"r-{i}"))
            for i in range(50)
        )
    )
    assert len({p.task.id for p in placed}) == 50 and len(q.store.tasks) == 50
    assert all(p.task.status is TaskStatus.QUEUED for p in placed)
    # Served in the order they arrived, each exactly once.
    served: list[str] = []
    while (head := await q.queue.next_task(ada.id, now=q.clock.now)) is not None:
        started = await q.queue.started(head, run_id=uuid.uuid4(), at=q.clock())
        served.append(started.input)
        await q.queue.succeeded(started, result="ok", at=q.clock())
    arrival = sorted(q.store.tasks.values(), key=lambda t: (t.created_at, t.id))
    assert served == [t.input for t in arrival] and len(set(served)) == 50


async def test_fifty_concurrent_submissions_with_one_request_id_make_one_task(q: Queue) -> None:
    ada = await q.agent()
    watcher, _ = q.hub.watch([ada.id])
    placed = await asyncio.gather(
        *(
            q.bus.handle(SubmitTask(caller=q.me, agent_id=str(ada.id), text="once", request_id="same"))
            for _ in range(50)
        )
    )
    assert {p.task.id for p in placed} == {placed[0].task.id}
    assert len(q.store.tasks) == 1
    assert drain(watcher) == [(TaskStatus.QUEUED, placed[0].task.id)]


async def test_submissions_are_checked(q: Queue) -> None:
    ada = await q.agent()
    stranger_im_member = q.im.human("mallory")
    other_workspace = caller_of(stranger_im_member.id, uuid.uuid4())
    cases: list[tuple[type[errors.ServiceError], Caller | None, str, dict[str, object]]] = [
        (errors.Unauthenticated, None, str(ada.id), {}),
        (errors.NotFound, other_workspace, str(ada.id), {}),
        (errors.InvalidArgument, q.me, "not-an-id", {}),
        (errors.NotFound, q.me, str(uuid.uuid4()), {}),
        (errors.InvalidArgument, q.me, str(ada.id), {"text": "  "}),
        (errors.InvalidArgument, q.me, str(ada.id), {"text": "é" * 40_000}),
        (errors.InvalidArgument, q.me, str(ada.id), {"request_id": "r" * 129}),
        (errors.InvalidArgument, q.me, str(ada.id), {"session_id": "nope"}),
        (errors.NotFound, q.me, str(ada.id), {"session_id": str(uuid.uuid4())}),
    ]
    for error, principal, agent_id, fields in cases:
        arguments: dict[str, object] = {"text": "do it", **fields}
        with pytest.raises(error):
            await q.bus.handle(SubmitTask(caller=principal, agent_id=agent_id, **arguments))  # type: ignore[arg-type]
    # Another agent's session is not this one's.
    bea = await q.agent("bea")
    with pytest.raises(errors.NotFound, match="session"):
        await q.submit(ada, session_id=str(bea.session_id))
    assert q.store.tasks == {}


async def test_a_task_may_name_another_session_of_its_agent(q: Queue) -> None:
    ada = await q.agent()
    side = Session(id=uuid.uuid4(), agent_id=ada.id, created_at=q.clock())
    await q.store.add_session(side)
    task = await q.submit(ada, session_id=str(side.id))
    assert task.session_id == side.id


async def test_the_input_limit_is_configurable() -> None:
    async for q in make_queue(max_task_input_bytes=10):
        ada = await q.agent()
        await q.submit(ada, "0123456789")
        with pytest.raises(errors.InvalidArgument, match="10"):
            await q.submit(ada, "0123456789a")


# Order and positions


async def test_higher_priority_first_then_arrival(q: Queue) -> None:
    ada = await q.agent()
    low = await q.submit(ada, "low", priority=0)
    high = await q.submit(ada, "high", priority=5)
    low2 = await q.submit(ada, "low 2", priority=0)
    high2 = await q.submit(ada, "high 2", priority=5)
    urgent = await q.submit(ada, "urgent", priority=9)
    positions = {
        t.input: (await q.tasks.get_task(q.me, str(t.id))).position for t in (low, high, low2, high2, urgent)
    }
    assert positions == {"urgent": 0, "high": 1, "high 2": 2, "low": 3, "low 2": 4}
    served = []
    while (head := await q.queue.next_task(ada.id, now=q.clock.now)) is not None:
        served.append(head.input)
        await q.queue.cancelled(await q.queue.started(head, run_id=uuid.uuid4(), at=q.clock()), at=q.clock())
    assert served == ["urgent", "high", "high 2", "low", "low 2"]


async def test_the_position_of_a_new_task_counts_the_tasks_ahead(q: Queue) -> None:
    ada = await q.agent()
    for i in range(3):
        assert (await q.bus.handle(SubmitTask(caller=q.me, agent_id=str(ada.id), text=f"t{i}"))).position == i
    # Higher priority goes ahead of them all; the running one is not in the queue.
    assert (
        await q.bus.handle(SubmitTask(caller=q.me, agent_id=str(ada.id), text="vip", priority=1))
    ).position == 0
    await q.run_next(ada)
    assert (await q.bus.handle(SubmitTask(caller=q.me, agent_id=str(ada.id), text="t3"))).position == 3


async def test_the_queue_kept_in_memory_serves_and_places_as_the_store_would() -> None:
    # The store's own next_task and tasks_ahead are the reference: after every
    # change (submissions of mixed priorities, starts, failures backing off,
    # cancellations, time passing), both agree.
    rng = random.Random(12)
    async for q in make_queue(
        jitter=rng.random, task_max_attempts=5, task_retry_base_seconds=10, task_retry_max_seconds=60
    ):
        ada = await q.agent()
        for _ in range(300):
            move = rng.random()
            if move < 0.45:
                await q.submit(ada, f"t{rng.random()}", priority=rng.choice([-1, 0, 0, 3]))
            elif move < 0.75:
                head = await q.queue.next_task(ada.id, now=q.clock.now)
                if head is not None:
                    running = await q.queue.started(head, run_id=uuid.uuid4(), at=q.clock())
                    if rng.random() < 0.5:
                        await q.queue.failed(running, error="boom", at=q.clock())
                    else:
                        await q.queue.succeeded(running, result="done", at=q.clock())
            elif move < 0.85:
                waiting = [t for t in q.store.tasks.values() if t.status in WAITING]
                if waiting:
                    await q.bus.handle(CancelTask(caller=q.me, task_id=str(rng.choice(waiting).id)))
            else:
                q.clock.now += timedelta(seconds=rng.uniform(0, 30))
            now = q.clock.now
            expected = await q.store.next_task(ada.id, now=now)
            assert await q.queue.next_task(ada.id, now=now) == expected
            assert await q.queue.next_retry_at(ada.id) == await q.store.next_retry_at(ada.id)
            for task in q.store.tasks.values():
                if task.status is TaskStatus.QUEUED:
                    placed = await q.tasks.get_task(q.me, str(task.id))
                    # Placing reads the clock (which the fake moves 1 ms a read): compare at that time.
                    assert placed.position == await q.store.tasks_ahead(task, now=q.clock.now)


# Running, retries, death


async def test_a_failed_task_is_retried_after_a_backoff_then_dead() -> None:
    async for q in make_queue(
        task_max_attempts=3, task_retry_base_seconds=10, task_retry_max_seconds=15, jitter=lambda: 0.0
    ):
        ada = await q.agent()
        watcher, _ = q.hub.watch([ada.id])
        task = await q.submit(ada, "flaky")
        first = await q.run_next(ada)
        assert first.status is TaskStatus.RUNNING and first.attempts == 1 and first.run_id is not None
        failed_at = q.clock()
        await q.queue.failed(first, error="boom 1", at=failed_at)
        stored = q.store.tasks[task.id]
        assert stored.status is TaskStatus.FAILED and stored.last_error == "boom 1"
        assert stored.retry_at == failed_at + timedelta(seconds=10)
        assert await q.queue.next_retry_at(ada.id) == stored.retry_at
        # Not due yet: not served; due: served again.
        assert await q.queue.next_task(ada.id, now=failed_at + timedelta(seconds=9)) is None
        q.clock.now = failed_at + timedelta(seconds=10)
        second = await q.run_next(ada)
        assert second.id == task.id and second.attempts == 2 and second.retry_at is None
        failed_at = q.clock()
        await q.queue.failed(second, error="boom 2", at=failed_at)
        # The wait doubles, up to the cap.
        assert q.store.tasks[task.id].retry_at == failed_at + timedelta(seconds=15)
        q.clock.now = failed_at + timedelta(seconds=15)
        third = await q.run_next(ada)
        await q.queue.failed(third, error="boom 3", at=q.clock())
        dead = q.store.tasks[task.id]
        assert dead.status is TaskStatus.DEAD and dead.attempts == 3 and dead.last_error == "boom 3"
        assert dead.ended_at is not None and dead.retry_at is None
        assert await q.queue.next_task(ada.id, now=q.clock.now + timedelta(days=1)) is None
        assert await q.queue.next_retry_at(ada.id) is None
        statuses = [s for s, _ in drain(watcher)]
        assert statuses == [
            TaskStatus.QUEUED,
            TaskStatus.RUNNING,
            TaskStatus.FAILED,
            TaskStatus.RUNNING,
            TaskStatus.FAILED,
            TaskStatus.RUNNING,
            TaskStatus.DEAD,
        ]


def test_the_backoff_doubles_up_to_its_cap_less_up_to_half_at_random() -> None:
    policy = RetryPolicy(max_attempts=9, base_seconds=2, max_seconds=60)
    assert [policy.delay(n, 0.0).total_seconds() for n in range(1, 7)] == [2, 4, 8, 16, 32, 60]
    assert policy.delay(3, 0.999).total_seconds() == pytest.approx(4.004)


async def test_a_task_that_succeeds_keeps_its_answer(q: Queue) -> None:
    ada = await q.agent()
    await q.submit(ada)
    running = await q.run_next(ada)
    await q.queue.succeeded(running, result="all done", at=q.clock())
    done = q.store.tasks[running.id]
    assert done.status is TaskStatus.SUCCEEDED and done.result == "all done" and done.ended_at is not None
    assert (await q.tasks.get_task(q.me, str(done.id))).position == 0


async def test_a_task_put_back_waits_again_and_its_attempt_does_not_count(q: Queue) -> None:
    ada = await q.agent()
    await q.submit(ada, "first")
    await q.submit(ada, "second")
    running = await q.run_next(ada)
    await q.queue.put_back(running)
    back = q.store.tasks[running.id]
    assert back.status is TaskStatus.QUEUED and back.attempts == 0
    # Still ahead of the later one.
    head = await q.queue.next_task(ada.id, now=q.clock.now)
    assert head is not None and head.id == running.id


# Cancellation


async def test_cancelling_a_waiting_task_is_immediate(q: Queue) -> None:
    ada = await q.agent()
    watcher, _ = q.hub.watch([ada.id])
    queued = await q.submit(ada, "queued")
    failing = await q.submit(ada, "failing")
    await q.bus.handle(CancelTask(caller=q.me, task_id=str(queued.id)))
    # A FAILED task waiting for its retry is cancelled too.
    running = await q.run_next(ada)
    assert running.id == failing.id
    await q.queue.failed(running, error="boom", at=q.clock())
    cancelled = (await q.bus.handle(CancelTask(caller=q.me, task_id=str(failing.id)))).task
    assert cancelled.status is TaskStatus.CANCELLED and cancelled.ended_at is not None
    assert cancelled.retry_at is None
    assert [s for s, _ in drain(watcher)] == [
        TaskStatus.QUEUED,
        TaskStatus.QUEUED,
        TaskStatus.CANCELLED,
        TaskStatus.RUNNING,
        TaskStatus.FAILED,
        TaskStatus.CANCELLED,
    ]
    assert await q.queue.next_task(ada.id, now=q.clock.now + timedelta(days=1)) is None
    # An ended task cannot be cancelled.
    with pytest.raises(errors.FailedPrecondition, match="cancelled"):
        await q.bus.handle(CancelTask(caller=q.me, task_id=str(queued.id)))


async def test_a_task_cancelled_before_it_starts_is_not_started(q: Queue) -> None:
    ada = await q.agent()
    await q.submit(ada)
    head = await q.queue.next_task(ada.id, now=q.clock.now)
    assert head is not None
    await q.bus.handle(CancelTask(caller=q.me, task_id=str(head.id)))
    started = await q.queue.started(head, run_id=uuid.uuid4(), at=q.clock())
    assert started.status is TaskStatus.CANCELLED and started.attempts == 0


async def test_cancelling_a_running_task_asks_its_runner_to_cut_it_short(q: Queue) -> None:
    ada = await q.agent()
    await q.submit(ada)
    running = await q.run_next(ada)
    q.runners.running.add(running.id)

    async def cut_short(task_id: uuid.UUID) -> None:
        # As AgentRunner does: the run ends, and the runner reports the task cancelled.
        await q.queue.cancelled(running, at=q.clock())

    q.runners.on_cancel = cut_short
    cancelled = (await q.bus.handle(CancelTask(caller=q.me, task_id=str(running.id)))).task
    assert q.runners.cancels == [running.id] and cancelled.status is TaskStatus.CANCELLED


async def test_a_cancelled_running_task_that_then_fails_is_not_retried() -> None:
    # CancelTask does not wait for the runner: it answers with the task as it is.
    async for q in make_queue(task_cancel_wait_seconds=0):
        ada = await q.agent()
        await q.submit(ada)
        running = await q.run_next(ada)
        q.runners.running.add(running.id)  # the runner will report later
        still = (await q.bus.handle(CancelTask(caller=q.me, task_id=str(running.id)))).task
        assert still.status is TaskStatus.RUNNING
        await q.queue.failed(running, error="cut", at=q.clock())
        assert q.store.tasks[running.id].status is TaskStatus.CANCELLED


async def test_a_running_task_nobody_runs_is_cancelled_at_once(q: Queue) -> None:
    ada = await q.agent()
    await q.submit(ada)
    running = await q.run_next(ada)
    await q.runners.stop_agent(ada.id)  # its runner is gone (the agent stays)
    cancelled = (await q.bus.handle(CancelTask(caller=q.me, task_id=str(running.id)))).task
    assert cancelled.status is TaskStatus.CANCELLED


async def test_clear_queue_cancels_every_waiting_task(q: Queue) -> None:
    ada = await q.agent()
    bea = await q.agent("bea")
    for i in range(4):
        await q.submit(ada, f"t{i}")
    other = await q.submit(bea, "other")
    running = await q.run_next(ada)
    failed = await q.queue.started(
        await q.submit(ada, "to fail", priority=9), run_id=uuid.uuid4(), at=q.clock()
    )
    await q.queue.failed(failed, error="boom", at=q.clock())
    watcher, _ = q.hub.watch(None)
    assert await q.queue.clear_queue(ada.id) == 4  # 3 queued and 1 awaiting a retry
    statuses = {t.input: t.status for t in q.store.tasks.values()}
    assert statuses == {
        "t0": TaskStatus.RUNNING,
        "t1": TaskStatus.CANCELLED,
        "t2": TaskStatus.CANCELLED,
        "t3": TaskStatus.CANCELLED,
        "to fail": TaskStatus.CANCELLED,
        "other": TaskStatus.QUEUED,
    }
    assert running.input == "t0" and other.status is TaskStatus.QUEUED
    assert [s for s, _ in drain(watcher)] == [TaskStatus.CANCELLED] * 4
    assert await q.queue.clear_queue(ada.id) == 0


# Views


async def test_tasks_are_listed_newest_first_in_pages(q: Queue) -> None:
    ada = await q.agent()
    submitted = [await q.submit(ada, f"t{i}") for i in range(5)]
    first, token = await q.tasks.list_tasks(q.me, str(ada.id), page_size=2, page_token="")
    second, token2 = await q.tasks.list_tasks(q.me, str(ada.id), page_size=2, page_token=token)
    third, end = await q.tasks.list_tasks(q.me, str(ada.id), page_size=2, page_token=token2)
    listed = [p.task.id for p in first + second + third]
    assert listed == [t.id for t in reversed(submitted)] and end == ""
    assert [p.position for p in first + second + third] == [4, 3, 2, 1, 0]
    with pytest.raises(errors.InvalidArgument):
        await q.tasks.list_tasks(q.me, str(ada.id), page_size=2, page_token="junk")
    with pytest.raises(errors.InvalidArgument):
        await q.tasks.list_tasks(q.me, str(ada.id), page_size=-1, page_token="")


async def test_tasks_of_other_workspaces_are_not_found(q: Queue) -> None:
    ada = await q.agent()
    task = await q.submit(ada)
    stranger = q.im.human("mallory")
    them = caller_of(stranger.id, uuid.uuid4())

    async def cancel(caller: Caller | None, task_id: str) -> Placed:
        return await q.bus.handle(CancelTask(caller=caller, task_id=task_id))

    for call in (q.tasks.get_task, cancel):
        with pytest.raises(errors.NotFound):
            await call(them, str(task.id))
        with pytest.raises(errors.NotFound):
            await call(q.me, str(uuid.uuid4()))
        with pytest.raises(errors.InvalidArgument):
            await call(q.me, "junk")
        with pytest.raises(errors.Unauthenticated):
            await call(None, str(task.id))
    with pytest.raises(errors.NotFound):
        await q.tasks.list_tasks(them, str(ada.id), page_size=0, page_token="")
    with pytest.raises(errors.NotFound):
        await q.tasks.queue_stats(them, str(ada.id))


async def test_queue_stats_count_waiting_and_running_and_average_the_wait(q: Queue) -> None:
    ada = await q.agent()
    stats = await q.tasks.queue_stats(q.me, str(ada.id))
    assert (stats.queued, stats.running, stats.average_wait_ms) == (0, False, 0.0)
    one = await q.submit(ada, "one")
    two = await q.submit(ada, "two")
    await q.submit(ada, "three")
    q.clock.now += timedelta(milliseconds=100)
    first = await q.run_next(ada)  # waited 100 ms and a few ticks
    await q.queue.failed(first, error="boom", at=q.clock())
    q.clock.now += timedelta(milliseconds=300)
    second = await q.run_next(ada)
    assert (first.id, second.id) == (one.id, two.id)
    stats = await q.tasks.queue_stats(q.me, str(ada.id))
    assert stats.queued == 2 and stats.running  # "three" and the failed "one"
    waits = [(t.started_at - t.created_at).total_seconds() * 1000 for t in (first, second) if t.started_at]
    assert stats.average_wait_ms == pytest.approx(sum(waits) / 2)
    assert 100 < stats.average_wait_ms < 500


# With the runner


async def test_the_runner_runs_queued_tasks_one_at_a_time_in_order() -> None:
    async for q in make_queue(run_tasks=True):
        ada = await q.agent()
        watcher, _ = q.hub.watch([ada.id])
        submitted = await asyncio.gather(
            *(
                q.bus.handle(
                    SubmitTask(caller=q.me, agent_id=str(ada.id), text=f"task {i}", request_id=f"r{i}")
                )
                for i in range(50)
            )
        )
        events: list[tuple[TaskStatus, uuid.UUID]] = []
        async with asyncio.timeout(WAIT):
            async for emitted in watcher.events():
                if isinstance(emitted.event, TaskChanged):
                    events.append((emitted.event.task.status, emitted.event.task.id))
                if sum(status is TaskStatus.SUCCEEDED for status, _ in events) == 50:
                    break
        arrival = [p.task.id for p in sorted(submitted, key=lambda p: (p.task.created_at, p.task.id))]
        # Never two running at once, and started in arrival order.
        running: set[uuid.UUID] = set()
        started: list[uuid.UUID] = []
        for status, task_id in events:
            if status is TaskStatus.RUNNING:
                assert not running
                running.add(task_id)
                started.append(task_id)
            elif status is TaskStatus.SUCCEEDED:
                running.discard(task_id)
        assert started == arrival
        assert all(t.attempts == 1 and t.result == "done" for t in q.store.tasks.values())


class SubmitDuringFirstLook:
    """The store's waiting_tasks, counting its queries; a task is submitted
    while the first one is under way."""

    def __init__(self, q: Queue, agent: Agent) -> None:
        self.q, self.agent = q, agent
        self.real = q.store.waiting_tasks
        self.queries = 0
        self.submitted: list[Task] = []

    async def __call__(self, agent_id: uuid.UUID) -> list[Task]:
        self.queries += 1
        found = await self.real(agent_id)
        if self.queries == 1:
            self.submitted.append(await self.q.submit(self.agent, "arrived meanwhile"))
        return found


async def test_an_agents_queue_is_read_once_unless_a_change_overtook_the_read() -> None:
    async for q in make_queue():
        ada = await q.agent()
        store = SubmitDuringFirstLook(q, ada)
        q.store.waiting_tasks = store  # type: ignore[method-assign]
        # That first read's "none" came before the submission: not remembered.
        assert await q.queue.next_task(ada.id, now=q.clock.now) is None
        head = await q.queue.next_task(ada.id, now=q.clock.now)
        assert head is not None and head.id == store.submitted[0].id
        await q.queue.started(head, run_id=uuid.uuid4(), at=q.clock())
        assert await q.queue.next_task(ada.id, now=q.clock.now) is None
        asked = store.queries
        assert asked == 2
        for _ in range(3):  # known now: no more queries
            assert await q.queue.next_task(ada.id, now=q.clock.now) is None
        later = await q.submit(ada, "later")
        again = await q.queue.next_task(ada.id, now=q.clock.now)
        assert again is not None and again.id == later.id
        assert store.queries == asked


def answer_lost(add_task: Callable[..., Awaitable[Task]]) -> Callable[..., Coroutine[Any, Any, Task]]:
    """The store's add_task, committing and then losing its connection before it answers."""

    async def committed_but_lost(task: Task, **options: Any) -> Task:
        await add_task(task, **options)
        raise DependencyUnavailable(DATABASE, "connection lost", connection_lost=True)

    return committed_but_lost


async def test_a_submission_whose_answer_was_lost_still_reaches_the_runner() -> None:
    async for q in make_queue(run_tasks=True):
        ada = await q.agent()
        runner = q.runner(ada)
        await asyncio.wait_for(runner.idle.wait(), WAIT)
        assert await q.queue.next_task(ada.id, now=q.clock.now) is None  # known to have none
        real = q.store.add_task
        q.store.add_task = answer_lost(real)  # type: ignore[method-assign]
        watcher, _ = q.hub.watch([ada.id])
        with pytest.raises(DependencyUnavailable):
            await q.submit(ada, "cut", request_id="r1")
        q.store.add_task = real  # type: ignore[method-assign]
        retried = await q.submit(ada, "cut", request_id="r1")  # the caller tries again: the same task
        async with asyncio.timeout(WAIT):
            async for emitted in watcher.events():
                event = emitted.event
                if isinstance(event, TaskChanged) and event.task.status is TaskStatus.SUCCEEDED:
                    assert event.task.id == retried.id
                    break


class OneTaskWriteFails:
    """The store's update_task, whose first write to `status` fails: before
    committing, or (`committed`) after, its answer lost with the connection."""

    def __init__(self, q: Queue, status: TaskStatus, *, committed: bool) -> None:
        self.real = q.store.update_task
        self.status = status
        self.committed = committed
        self.failed = False

    async def __call__(
        self, task: Task, *, expected: Collection[TaskStatus], fence: Fence | None = None
    ) -> bool:
        if self.failed or task.status is not self.status:
            return await self.real(task, expected=expected, fence=fence)
        self.failed = True
        if self.committed:
            await self.real(task, expected=expected, fence=fence)
        raise DependencyUnavailable(DATABASE, "connection lost", connection_lost=True)


@pytest.mark.parametrize(
    ("status", "committed"),
    [(TaskStatus.RUNNING, True), (TaskStatus.RUNNING, False), (TaskStatus.SUCCEEDED, False)],
)
async def test_a_task_whose_bookkeeping_the_database_lost_still_runs_to_its_end(
    status: TaskStatus, committed: bool
) -> None:
    async for q in make_queue(run_tasks=True):
        ada = await q.agent()
        q.store.update_task = OneTaskWriteFails(q, status, committed=committed)  # type: ignore[method-assign]
        watcher, _ = q.hub.watch([ada.id])
        task = await q.submit(ada, "do it")
        async with asyncio.timeout(WAIT):
            async for emitted in watcher.events():
                event = emitted.event
                if isinstance(event, TaskChanged) and event.task.status is TaskStatus.SUCCEEDED:
                    assert event.task.id == task.id
                    break
        runner = q.runner(ada)
        await asyncio.wait_for(runner.idle.wait(), WAIT)
        assert q.store.agents[ada.id].state is AgentState.IDLE
        assert all(r.status is not RunStatus.RUNNING for r in q.store.runs.values())


class BeginFailsOnce:
    """The store's begin_run, whose first write fails before committing."""

    def __init__(self, q: Queue) -> None:
        self.real = q.store.begin_run
        self.failed = False

    async def __call__(self, *args: Any, **kwargs: Any) -> None:
        if not self.failed:
            self.failed = True
            raise DependencyUnavailable(DATABASE, "connection lost", connection_lost=True)
        await self.real(*args, **kwargs)


async def test_a_task_whose_run_was_never_stored_goes_back_to_the_queue_and_runs() -> None:
    """The task is marked RUNNING, then the write that begins its run fails:
    the runner puts the task back and must look at the queue once more (no
    submission will come to wake it)."""
    async for q in make_queue(run_tasks=True):
        ada = await q.agent()
        q.store.begin_run = begin = BeginFailsOnce(q)  # type: ignore[method-assign]
        watcher, _ = q.hub.watch([ada.id])
        task = await q.submit(ada, "do it")
        async with asyncio.timeout(WAIT):
            async for emitted in watcher.events():
                event = emitted.event
                if isinstance(event, TaskChanged) and event.task.status is TaskStatus.SUCCEEDED:
                    assert event.task.id == task.id
                    break
        assert begin.failed


async def test_a_task_waiting_behind_an_older_message_runs_after_it() -> None:
    """One look finds both: the message, older, is answered first; the task
    must not then wait for some later wake."""
    async for q in make_queue(run_tasks=True):
        ada = await q.agent()
        await q.app.runners.apply(ada.id, Control.PAUSE)
        chat = q.im.group("", q.me.member_id, ada.member_id, direct=True)  # type: ignore[arg-type]
        q.im.clock = q.clock  # one clock: the message is older than the task
        q.im.post(q.me.member_id, chat.id, "first, a question")  # type: ignore[arg-type]
        watcher, _ = q.hub.watch([ada.id])
        task = await q.submit(ada, "then, a task")
        await q.app.runners.apply(ada.id, Control.RESUME)
        async with asyncio.timeout(WAIT):
            async for emitted in watcher.events():
                event = emitted.event
                if isinstance(event, TaskChanged) and event.task.status is TaskStatus.SUCCEEDED:
                    assert event.task.id == task.id
                    break
        assert [m.content for m in q.im.in_group(chat.id)][:2] == ["first, a question", "done"]
