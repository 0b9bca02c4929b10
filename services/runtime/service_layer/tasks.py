"""The per-agent task queue (issue 5): submission (idempotent), ordering,
retries with backoff, cancellation and statistics.

A submitted task is QUEUED. The agent's runner takes the head of the queue
(`next_task`) in its turn and reports through the `TaskQueue` port:
`started` (RUNNING, one more attempt), then `succeeded` (SUCCEEDED),
`failed` (FAILED with a retry due after a backoff, or DEAD once out of
attempts), `put_back` (QUEUED again: the run was interrupted, the attempt
does not count) or `cancelled` (CANCELLED). Every change of status is a
`TaskChanged` event on the agent's stream. Each change is a compare-and-set
on the stored status, so that a person cancelling and the runner starting or
ending the same task never both win.

A TERMINATED or PAUSED agent still accepts tasks: they wait in its queue
until it is started or resumed (or are cancelled by terminating it with
its queue cleared, `clear_queue`).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import random
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from services.common import errors
from services.common.identity import Caller
from services.runtime.domain.errors import (
    AgentNotFound,
    InvalidTaskRequest,
    SessionNotFound,
    TaskNotFound,
)
from services.runtime.domain.llm import Role
from services.runtime.domain.model import (
    Agent,
    AgentState,
    Emitted,
    Placed,
    Run,
    RunStatus,
    Task,
    TaskChanged,
    TaskStatus,
    shown_to_model,
)
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.leases import Fence
from services.runtime.service_layer.store import AgentStore, TaskInFlight
from services.runtime.service_layer.work import TaskQueue

logger = logging.getLogger(__name__)

# In the queue: waiting for the first attempt, or for a retry.
WAITING = (TaskStatus.QUEUED, TaskStatus.FAILED)
MAX_REQUEST_ID_CHARS = 128  # the width of tasks.request_id


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How failed tasks are retried.

    After its n-th failed attempt a task waits `base_seconds * 2**(n-1)`
    (at most `max_seconds`), less up to half of that at random so that
    tasks which failed together do not all come back at once. The
    `max_attempts`-th failure is final: the task is DEAD.
    """

    max_attempts: int = 3
    base_seconds: float = 5.0
    max_seconds: float = 300.0

    def delay(self, attempts: int, jitter: float) -> timedelta:
        """The wait after `attempts` failed attempts; `jitter` is in [0, 1)."""
        full = min(self.max_seconds, self.base_seconds * 2 ** max(0, attempts - 1))
        return timedelta(seconds=full * (1 - jitter / 2))


@dataclass(frozen=True, slots=True)
class QueueStats:
    """An agent's queue: tasks waiting (QUEUED or FAILED awaiting a retry),
    whether one is running, and the mean wait from submission to start."""

    queued: int
    running: bool
    average_wait_ms: float


class StoredTaskQueue(TaskQueue):
    """The queue the agents' runners take their tasks from, kept in the
    `AgentStore` (the runners' `TaskQueue` port), and the changes of status
    the task commands make (`handlers.tasks`).

    Args:
        retry: how failed tasks are retried.
        jitter: a source of numbers in [0, 1) for the retry backoff.
    """

    def __init__(
        self,
        *,
        store: AgentStore,
        hub: AgentHub,
        clock: Callable[[], datetime],
        retry: RetryPolicy | None = None,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self._hub = hub
        self._clock = clock
        self._retry = retry or RetryPolicy()
        self._jitter = jitter
        # Running tasks a person cancelled: however their run ends (short of
        # succeeding), they end CANCELLED, never retried.
        self._cancelling: set[uuid.UUID] = set()
        # Set when a running task stops running (CancelTask waits for it).
        self._stopped: dict[uuid.UUID, asyncio.Event] = {}
        # Each agent's queue as this process knows it, so that a runner looking
        # for work (at every message), a submission placing its task and a
        # retry being scheduled cost no query: read from the store once, then
        # kept with every change made here (the tasks of an agent are
        # submitted and run through the process that runs it). A write whose
        # outcome is unknown forgets the agent's queue: it is read again.
        self._queues: dict[uuid.UUID, _Queue] = {}
        # Bumped by each change of an agent's queue: a read begun before one is not kept.
        self._changes: dict[uuid.UUID, int] = {}
        # The running tasks as last stored here (what ending one starts from).
        self._running: dict[uuid.UUID, Task] = {}
        # Agents with a task this process marked RUNNING and has not yet seen
        # ended: only those can have an orphan once their runner is idle.
        self._unsettled: set[uuid.UUID] = set()

    # -- for the task RPCs ----------------------------------------------------

    def added(self, task: Task) -> None:
        """A task was stored as QUEUED: it takes its place in the agent's queue."""
        self._queued(task)

    def may_have_changed(self, agent_id: uuid.UUID) -> None:
        """A write's outcome is unknown (its answer was lost): the agent's
        queue is read again when next needed."""
        self._forget(agent_id)

    def left(self, task: Task) -> None:
        """A waiting task was stored as no longer waiting (a person cancelled it)."""
        self._left_queue(task)

    async def ahead_of(self, task: Task) -> int:
        """How many tasks the agent's runner would take before `task`."""
        return (await self._queue(task.agent_id)).ahead_of(task, now=self._clock())

    def publish(self, task: Task, *, workspace_id: uuid.UUID | None = None) -> None:
        """Tells the agent's watchers (of `workspace_id`, wherever they watch) the task's new status."""
        self._publish(task, workspace_id=workspace_id)

    def cancelling(self, task: Task) -> asyncio.Event:
        """A person cancels the RUNNING task: however its run ends (short of
        succeeding), it ends CANCELLED. The event is set once it stops running."""
        self._cancelling.add(task.id)
        return self._stopped.setdefault(task.id, asyncio.Event())

    async def cancel_unrun(self, task: Task) -> bool:
        """Cancels a RUNNING task no runner goes on with (its run was lost with its process)."""
        return await self._end(
            task,
            lambda t: replace(t, status=TaskStatus.CANCELLED, ended_at=self._clock()),
            quiet=True,
        )

    async def reread(self, task: Task) -> Task:
        """The task as stored now."""
        return await self._reread(task)

    async def clear_queue(self, agent_id: uuid.UUID) -> int:
        """Cancels every waiting (QUEUED or FAILED) task of the agent, as
        terminating it with QUEUE_POLICY_CLEAR does; returns how many."""
        try:
            ended = await self._store.cancel_waiting_tasks(agent_id, at=self._clock())
        finally:
            self._forget(agent_id)
        for task in ended:
            self._publish(task)
        return len(ended)

    # -- the runner's port (TaskQueue) ------------------------------------------

    async def next_task(self, agent_id: uuid.UUID, *, now: datetime) -> Task | None:
        while True:
            queue = await self._queue(agent_id)
            head = queue.head(now)
            if head is None:
                return None
            if head.task is not None:
                return head.task
            task = await self._store.get_task(head.id)
            if task is not None and task.status in WAITING:
                return task
            # Changed by someone else meanwhile: this queue is not to be trusted.
            self._forget(agent_id)

    async def next_retry_at(self, agent_id: uuid.UUID) -> datetime | None:
        return (await self._queue(agent_id)).next_retry_at()

    async def _queue(self, agent_id: uuid.UUID) -> _Queue:
        """The agent's queue, read from the store unless known."""
        known = self._queues.get(agent_id)
        if known is not None:
            return known
        seen = self._changes.get(agent_id, 0)
        read = _Queue(await self._store.waiting_tasks(agent_id))
        if seen == self._changes.get(agent_id, 0):
            self._queues[agent_id] = read
        return read

    def _changed(self, agent_id: uuid.UUID) -> _Queue | None:
        """Notes a change of the agent's queue; the queue if it is known."""
        self._changes[agent_id] = self._changes.get(agent_id, 0) + 1
        return self._queues.get(agent_id)

    def _queued(self, task: Task) -> None:
        """The task is (again) waiting, as stored."""
        queue = self._changed(task.agent_id)
        if queue is not None:
            queue.put(task)

    def _left_queue(self, task: Task) -> None:
        """The task is no longer waiting."""
        queue = self._changed(task.agent_id)
        if queue is not None:
            queue.remove(task.id)

    def adopt(self, agent_ids: Collection[uuid.UUID]) -> None:
        for agent_id in agent_ids:
            self._forget(agent_id)
            self._unsettled.add(agent_id)

    def let_go(self, agent_ids: Collection[uuid.UUID]) -> None:
        for agent_id in agent_ids:
            self._forget(agent_id)
            self._unsettled.discard(agent_id)

    def _forget(self, agent_id: uuid.UUID) -> None:
        """The agent's queue may have changed unseen: it is read again when next needed."""
        self._changed(agent_id)
        self._queues.pop(agent_id, None)

    async def started(
        self, task: Task, *, run_id: uuid.UUID, at: datetime, fence: Fence | None = None
    ) -> Task:
        """Marks it RUNNING (one more attempt). If it is no longer waiting (a
        person cancelled it since `next_task`), returns it as stored, not
        RUNNING: the runner must then not run it."""
        if task.status in WAITING:
            running = replace(
                task,
                status=TaskStatus.RUNNING,
                attempts=task.attempts + 1,
                started_at=at,
                ended_at=None,
                retry_at=None,
                run_id=run_id,
            )
            self._unsettled.add(task.agent_id)
            try:
                stored = await self._store.update_task(running, expected=WAITING, fence=fence)
            except errors.Unavailable:
                self._forget(task.agent_id)  # the write may have committed all the same
                raise
            if stored:
                self._left_queue(running)
                self._running[running.id] = running
                self._publish(running)
                return running
            self._forget(task.agent_id)  # changed by someone else meanwhile
        current = await self._reread(task)
        logger.info("task %s is %s: not started", current.id, current.status.value)
        return current

    async def running_task(self, agent_id: uuid.UUID) -> TaskInFlight | None:
        found = await self._store.running_tasks(agent_id)
        if found:
            self._unsettled.add(agent_id)
        return found[-1] if found else None

    async def continued(self, task: Task, *, run_id: uuid.UUID, fence: Fence | None = None) -> Task:
        moved = replace(task, run_id=run_id)
        self._unsettled.add(task.agent_id)
        self._running.pop(task.id, None)  # unknown until this write is known stored
        if await self._store.update_task(moved, expected=(TaskStatus.RUNNING,), fence=fence):
            self._running[moved.id] = moved
            self._publish(moved)
            return moved
        return await self._reread(task)

    async def settle_as_run_ended(self, found: TaskInFlight, *, fence: Fence | None = None) -> bool:
        run = found.run
        if run is not None and run.status is RunStatus.RUNNING:
            return False
        if not await self._end(found.task, await self._orphan_outcome(run), quiet=True, fence=fence):
            return False
        logger.info(
            "task %s was left running by a run that %s; now settled",
            found.task.id,
            "was never stored" if run is None else f"ended {run.status.value}",
        )
        return True

    async def settle_orphans(
        self, agent_id: uuid.UUID | None = None, *, fence: Fence | None = None
    ) -> list[Task]:
        if agent_id is not None and agent_id not in self._unsettled:
            return []
        settled: list[Task] = []
        kept = False
        for found in await self._store.running_tasks(agent_id):
            if found.agent_state in (AgentState.RUNNING, AgentState.PAUSED):
                kept = True  # its agent goes on with it, after a restart or when resumed
            elif await self.settle_as_run_ended(found, fence=fence):
                settled.append(found.task)
            else:
                kept = True
        if agent_id is not None and not kept:
            self._unsettled.discard(agent_id)
        return settled

    async def _orphan_outcome(self, run: Run | None) -> Callable[[Task], Task]:
        """How a task ends whose run is gone (None) or ended without settling it."""
        at = self._clock()
        if run is None or run.status is RunStatus.INTERRUPTED:
            return self._put_back_outcome
        if run.status is RunStatus.COMPLETED:
            answer = await self._answer_of(run)
            return lambda t: replace(t, status=TaskStatus.SUCCEEDED, result=answer, ended_at=at)
        error = run.error or run.status.value
        return lambda t: self._failure_outcome(t, error, at)

    async def _answer_of(self, run: Run) -> str:
        """The last thing the model said in a run: its answer."""
        steps = await self._store.list_steps(run.session_id, after_sequence=0, limit=100_000, run_id=run.id)
        said = [s for s in shown_to_model(steps) if s.role is Role.ASSISTANT]
        if not said:
            return ""
        return said[-1].message.content or ""

    async def succeeded(self, task: Task, *, result: str, at: datetime, fence: Fence | None = None) -> None:
        await self._end(
            task, lambda t: replace(t, status=TaskStatus.SUCCEEDED, result=result, ended_at=at), fence=fence
        )

    async def failed(self, task: Task, *, error: str, at: datetime, fence: Fence | None = None) -> None:
        await self._end(task, lambda t: self._failure_outcome(t, error, at), fence=fence)

    def _failure_outcome(self, t: Task, error: str, at: datetime) -> Task:
        if t.id in self._cancelling:
            return replace(t, status=TaskStatus.CANCELLED, last_error=error, ended_at=at)
        if t.attempts >= self._retry.max_attempts:
            return replace(t, status=TaskStatus.DEAD, last_error=error, ended_at=at, retry_at=None)
        delay = self._retry.delay(t.attempts, self._jitter())
        return replace(t, status=TaskStatus.FAILED, last_error=error, retry_at=at + delay)

    async def put_back(self, task: Task, *, fence: Fence | None = None) -> None:
        await self._end(task, self._put_back_outcome, fence=fence)

    def _put_back_outcome(self, t: Task) -> Task:
        if t.id in self._cancelling:
            return replace(t, status=TaskStatus.CANCELLED, ended_at=self._clock())
        return replace(t, status=TaskStatus.QUEUED, attempts=max(0, t.attempts - 1), retry_at=None)

    async def cancelled(self, task: Task, *, at: datetime, fence: Fence | None = None) -> None:
        await self._end(
            task, lambda t: replace(t, status=TaskStatus.CANCELLED, ended_at=at, retry_at=None), fence=fence
        )

    async def _reread(self, task: Task) -> Task:
        return await self._store.get_task(task.id) or task

    async def _end(
        self,
        task: Task,
        outcome: Callable[[Task], Task],
        *,
        quiet: bool = False,
        fence: Fence | None = None,
    ) -> bool:
        """Moves a running task on to `outcome(stored task)` (compare-and-set);
        False if it was no longer running."""
        # As this process last stored it (only this process runs it), else as stored.
        current = self._running.pop(task.id, None) or await self._reread(task)
        changed = outcome(current)
        try:
            stored = await self._store.update_task(changed, expected=(TaskStatus.RUNNING,), fence=fence)
        except errors.Unavailable:
            if changed.status in WAITING:
                self._forget(task.agent_id)  # the write may have committed all the same
            raise
        if not stored:
            if not quiet:
                logger.warning("task %s is no longer running: not marked %s", task.id, changed.status.value)
            return False
        # One task runs at a time per agent: this was the one left to settle.
        self._unsettled.discard(task.agent_id)
        self._cancelling.discard(task.id)
        if changed.status in WAITING:
            self._queued(changed)
        stopped = self._stopped.pop(task.id, None)
        if stopped is not None:
            stopped.set()
        self._publish(changed)
        return True

    def _publish(self, task: Task, *, workspace_id: uuid.UUID | None = None) -> None:
        self._hub.publish(Emitted(task.agent_id, self._clock(), TaskChanged(task)), workspace_id=workspace_id)


class TaskViews:
    """The reads of tasks (GetTask, ListTasks, GetQueueStats) and who may see
    a task; the changes are the handlers' (`handlers.tasks`).

    Args:
        max_page_size: the largest page of ListTasks.
    """

    def __init__(
        self,
        *,
        store: AgentStore,
        queue: StoredTaskQueue,
        access: AgentAccess,
        clock: Callable[[], datetime],
        max_page_size: int = 200,
    ) -> None:
        self._store = store
        self._queue = queue
        self._access = access
        self._clock = clock
        self._max_page = max_page_size

    async def get_task(self, principal: Caller | None, task_id: str) -> Placed:
        return await self.placed(await self.visible(principal, task_id))

    async def list_tasks(
        self, principal: Caller | None, agent_id: str, *, page_size: int, page_token: str
    ) -> tuple[list[Placed], str]:
        """An agent's tasks, newest first, and the token of the next page ("" at the end)."""
        agent = await self._access.controlled(principal, agent_id)
        if page_size < 0:
            raise InvalidTaskRequest("page_size must not be negative")
        limit = min(page_size or 50, self._max_page)
        before = _parse_id(page_token, "page_token") if page_token else None
        tasks = await self._store.list_tasks(agent.id, before=before, limit=limit + 1)
        page = [await self.placed(t) for t in tasks[:limit]]
        return page, str(tasks[limit - 1].id) if len(tasks) > limit else ""

    async def queue_stats(self, principal: Caller | None, agent_id: str) -> QueueStats:
        agent = await self._access.controlled(principal, agent_id)
        waiting, running, average = await self._store.queue_stats(agent.id)
        return QueueStats(queued=waiting, running=running > 0, average_wait_ms=average)

    # -- helpers ------------------------------------------------------------------

    async def visible(self, principal: Caller | None, task_id: str) -> Task:
        """The task, if the caller may see its agent (NOT_FOUND otherwise, as for agents)."""
        wanted = _parse_id(task_id, "task_id")
        task = await self._store.get_task(wanted)
        try:
            # Asked even for a missing task: an unauthenticated caller learns nothing.
            await self._access.controlled(principal, str(task.agent_id if task else uuid.UUID(int=0)))
        except AgentNotFound:
            task = None
        if task is None:
            raise TaskNotFound(f"task {wanted} not found")
        return task

    async def session_of(self, agent: Agent, session_id: str) -> uuid.UUID:
        """The session a task of `agent` works in: its main one, unless
        `session_id` names another of its own."""
        if not session_id:
            return agent.session_id
        wanted = _parse_id(session_id, "session_id")
        if wanted != agent.session_id:
            session = await self._store.get_session(wanted)
            if session is None or session.agent_id != agent.id:
                raise SessionNotFound(f"session {wanted} of agent {agent.id} not found")
        return wanted

    async def placed(self, task: Task) -> Placed:
        """The task, with its place in the queue while QUEUED."""
        if task.status is not TaskStatus.QUEUED:
            return Placed(task)
        return Placed(task, await self._queue.ahead_of(task))


# A waiting task is kept whole in `_Queue` up to this input size; a larger
# one is read again when its turn comes, so that a long queue of large tasks
# costs memory only for their place in it.
_KEPT_INPUT_CHARS = 4096


@dataclass(frozen=True, slots=True)
class _Place:
    """A waiting task's place in its agent's queue (and the task, if kept)."""

    id: uuid.UUID
    priority: int
    created_at: datetime
    status: TaskStatus
    retry_at: datetime | None
    task: Task | None

    @property
    def order(self) -> tuple[int, datetime, uuid.UUID]:
        return (-self.priority, self.created_at, self.id)

    def due(self, now: datetime) -> bool:
        """Its turn may come: QUEUED, or FAILED with its retry due."""
        return self.status is TaskStatus.QUEUED or (self.retry_at is not None and self.retry_at <= now)


class _Queue:
    """An agent's waiting tasks, in the order they are served: the QUEUED ones
    in a sorted list (a long queue costs a binary search, not a scan), the
    FAILED ones awaiting a retry (few: those backing off) aside."""

    def __init__(self, waiting: list[Task]) -> None:
        self._places: dict[uuid.UUID, _Place] = {}
        self._queued: list[tuple[int, datetime, uuid.UUID]] = []  # the QUEUED places' orders, sorted
        self._retrying: dict[uuid.UUID, _Place] = {}
        for task in waiting:
            self.put(task)

    def put(self, task: Task) -> None:
        self.remove(task.id)
        kept = task if len(task.input) <= _KEPT_INPUT_CHARS else None
        place = _Place(task.id, task.priority, task.created_at, task.status, task.retry_at, kept)
        self._places[task.id] = place
        if place.status is TaskStatus.QUEUED:
            bisect.insort(self._queued, place.order)
        else:
            self._retrying[task.id] = place

    def remove(self, task_id: uuid.UUID) -> None:
        place = self._places.pop(task_id, None)
        if place is None:
            return
        if place.status is TaskStatus.QUEUED:
            del self._queued[bisect.bisect_left(self._queued, place.order)]
        else:
            del self._retrying[task_id]

    def head(self, now: datetime) -> _Place | None:
        """The next task to serve: the highest priority, then the oldest."""
        due = [p for p in self._retrying.values() if p.due(now)]
        if self._queued:
            due.append(self._places[self._queued[0][2]])
        return min(due, key=lambda p: p.order, default=None)

    def ahead_of(self, task: Task, *, now: datetime) -> int:
        """How many tasks `head` would serve before `task`."""
        order = (-task.priority, task.created_at, task.id)
        retries = sum(1 for p in self._retrying.values() if p.due(now) and p.order < order)
        return bisect.bisect_left(self._queued, order) + retries

    def next_retry_at(self) -> datetime | None:
        return min((p.retry_at for p in self._retrying.values() if p.retry_at is not None), default=None)


def _parse_id(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidTaskRequest(f"{field} is not a valid id: {value[:64]!r}") from None
